#!/usr/bin/env bash
# Run a command with the kernel's session autogroups off, restoring the setting afterwards.
#
# With autogroups on, every process that starts a session (each engine, metaserver and proxy
# the tests start) is scheduled as its own group; on the suite's 2-core VM a vLLM worker that
# waits by spinning on sched_yield (tensor parallelism 2) then kept a CPU to itself for 50-240 s
# at a time while other runnable tasks, kernel threads included, waited. Off, the same module
# ran with no stall at all (docs/development.md, "Engines with TP 2 on this VM").
set -uo pipefail
knob=/proc/sys/kernel/sched_autogroup_enabled
old=""
if [[ -r $knob ]]; then
  old=$(<"$knob")
  if [[ $old != 0 ]]; then
    if echo 0 2>/dev/null >"$knob"; then
      echo ">> kernel.sched_autogroup_enabled 0 while the tests run (was $old; see docs/development.md)"
    else
      echo ">> WARNING: kernel.sched_autogroup_enabled is $old and cannot be changed here (not root?);" \
        "engines with tensor parallelism 2 may stall this machine (docs/development.md)"
      old=""
    fi
  else
    old=""
  fi
fi
restore() { [[ -n $old ]] && echo "$old" >"$knob"; }
trap restore EXIT
"$@"
