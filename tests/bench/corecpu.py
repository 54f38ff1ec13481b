"""CPU time of the threads confined to one core, for ``ttft_bench.py --pinned`` (Linux /proc).

The pinned bench runs the monolithic engine, then P, alone on one core. Whether P/D's TTFT
lost time on that core to pdgate (the connector's threads next to the forward) or to the
machine (the same forward running slower between the two phases) shows in the threads' CPU
time: the busiest thread is the forward, everything else on the core is the rest.
"""

from __future__ import annotations

import os
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Snapshot:
    processes: dict[int, float]  # pid -> user + system seconds (its ended threads included)
    threads: dict[tuple[int, int], float]  # (pid, tid) -> user + system seconds


@dataclass(frozen=True, slots=True)
class CoreCpu:
    forward_s: float  # the busiest thread
    others_s: float  # everything else the core's processes used (ended threads included)


def _confined_to(pid: str, core: str) -> bool:
    """A user process (kernel threads have no command line) allowed on ``core`` only."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            if not f.read(1):
                return False
        with open(f"/proc/{pid}/status") as f:
            return f"\nCpus_allowed_list:\t{core}\n" in f.read()
    except OSError:
        return False


def stat_fields(stat_path: str) -> list[str]:
    """The fields of a ``/proc/.../stat`` line after the command name: [0] is the state, [2]
    the process group, [11] and [12] user and system time in clock ticks."""
    with open(stat_path) as f:
        return f.read().rsplit(")", 1)[1].split()


def cpu_ticks(fields: list[str]) -> int:
    """User + system time of ``stat_fields``, in clock ticks."""
    return int(fields[11]) + int(fields[12])


def _cpu(stat_path: str, tick: int) -> float:
    return cpu_ticks(stat_fields(stat_path)) / tick


def snapshot(core: str) -> Snapshot:
    """Every user process whose affinity is exactly ``core``, and each of its threads."""
    tick = os.sysconf("SC_CLK_TCK")
    snap = Snapshot({}, {})
    for pid in filter(str.isdigit, os.listdir("/proc")):
        if not _confined_to(pid, core):
            continue
        try:
            snap.processes[int(pid)] = _cpu(f"/proc/{pid}/stat", tick)
            tids = os.listdir(f"/proc/{pid}/task")
        except OSError:
            continue
        for tid in tids:
            try:
                snap.threads[(int(pid), int(tid))] = _cpu(f"/proc/{pid}/task/{tid}/stat", tick)
            except OSError:
                continue
    return snap


def spent(before: Snapshot, after: Snapshot) -> CoreCpu:
    """What the core's processes used between two snapshots (one born in between counts
    whole; one that ended in between is not seen)."""
    total = sum(t - before.processes.get(pid, 0.0) for pid, t in after.processes.items())
    forward = max((t - before.threads.get(k, 0.0) for k, t in after.threads.items()), default=0.0)
    return CoreCpu(forward, max(0.0, total - forward))
