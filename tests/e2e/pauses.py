"""Machine pauses: stretches in which no CPU of this machine ran the suite's watchers.

On the suites' 2-core VM, one watcher process pinned to each CPU, each waking every 20-50 ms,
has seen both woken 10-40 s late at the same instant (2026-11-25, during fresh-clone
``make test`` runs), with no steal time counted in ``/proc/stat``; most of pdgate's processes
stood still in the same stretches. Whether the host stopped the VM or the guest starved its
light processes is not established (docs/reliability.md). Either way a request cannot end
while nothing serving it runs, so the chaos suite judges "hung" in running time: wall time
less the pauses (``within``).

``PauseWatch`` runs one such watcher per CPU this process may use; a *pause* is a stretch that
every watcher missed (one CPU alone missing a tick is not counted)."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
from collections.abc import Awaitable
from pathlib import Path
from typing import Protocol, TypeVar

T = TypeVar("T")
MIN_GAP_S = 0.5  # a watcher records each gap between its ticks longer than this

_WATCHER = """
import os, sys, time
os.sched_setaffinity(0, {int(sys.argv[1])})
out = open(sys.argv[2], "a", buffering=1)
gap, last = float(sys.argv[3]), time.monotonic()
out.write("ticking\\n")
while True:
    time.sleep(0.02)
    now = time.monotonic()
    if now - last > gap:
        out.write(f"{last:.4f} {now:.4f}\\n")
    last = now
"""

Span = tuple[float, float]  # time.monotonic() readings (one clock for every process)


class Pauses(Protocol):
    def paused_s(self, since: float, until: float) -> float: ...


def overlap(a: list[Span], b: list[Span]) -> list[Span]:
    """The stretches covered by both lists (each sorted and non-overlapping)."""
    out: list[Span] = []
    i = j = 0
    while i < len(a) and j < len(b):
        lo, hi = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        if lo < hi:
            out.append((lo, hi))
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return out


class PauseWatch:
    def __init__(self, workdir: Path, min_gap_s: float = MIN_GAP_S) -> None:
        self.workdir = workdir
        self.min_gap_s = min_gap_s
        self.cpus = sorted(os.sched_getaffinity(0))
        self.procs: list[subprocess.Popen[bytes]] = []

    def _file(self, cpu: int) -> Path:
        return self.workdir / f"gaps-cpu{cpu}.txt"

    def start(self) -> PauseWatch:
        self.workdir.mkdir(parents=True, exist_ok=True)
        for cpu in self.cpus:
            self._file(cpu).write_text("")
            argv = [sys.executable, "-c", _WATCHER, str(cpu), str(self._file(cpu))]
            self.procs.append(subprocess.Popen([*argv, str(self.min_gap_s)]))
        return self

    def wait_ticking(self, timeout_s: float = 120.0) -> None:
        """Until every watcher runs its loop (a new Python process takes a while to get there
        on a loaded machine, and it records nothing before)."""
        deadline = time.monotonic() + timeout_s
        while not all("ticking" in self._file(c).read_text() for c in self.cpus):
            if time.monotonic() > deadline:
                raise RuntimeError(f"the pause watchers did not start in {timeout_s}s")
            time.sleep(0.02)

    def stop(self) -> None:
        for p in self.procs:
            p.kill()
            p.wait()
        self.procs.clear()

    def __enter__(self) -> PauseWatch:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def gaps(self, cpu: int) -> list[Span]:
        spans = []
        for line in self._file(cpu).read_text().splitlines():
            lo, _, hi = line.partition(" ")
            if hi:
                spans.append((float(lo), float(hi)))
        return spans

    def pauses(self, since: float = 0.0, until: float = float("inf")) -> list[Span]:
        """The stretches every CPU's watcher missed, clipped to ``[since, until]``."""
        common: list[Span] | None = None
        for cpu in self.cpus:
            common = self.gaps(cpu) if common is None else overlap(common, self.gaps(cpu))
        clipped = [(max(lo, since), min(hi, until)) for lo, hi in common or []]
        return [(lo, hi) for lo, hi in clipped if lo < hi]

    def cpu_stalls(self, since: float = 0.0, until: float = float("inf")) -> dict[int, float]:
        """Per CPU, the longest stretch its own watcher missed in ``[since, until]`` (another CPU
        may have run meanwhile). Whatever process was on that CPU then stood still as long: the
        kernel's fair scheduler does not keep a 20 ms sleeper off a CPU for seconds, not even
        at this suite's load (about 33 runnable threads on 2 CPUs)."""
        out: dict[int, float] = {}
        for cpu in self.cpus:
            spans = [(max(lo, since), min(hi, until)) for lo, hi in self.gaps(cpu)]
            out[cpu] = max((hi - lo for lo, hi in spans if lo < hi), default=0.0)
        return out

    def paused_s(self, since: float, until: float) -> float:
        return sum(hi - lo for lo, hi in self.pauses(since, until))

    def describe(self, since: float, until: float) -> str:
        """For a note: ``"; the machine paused 19.8s, 10.1s (and 3 shorter, 1.2s in all)"``, or
        ``""``. Stretches under a second are mostly both CPUs busy at once, listed only as a sum."""
        spans = [hi - lo for lo, hi in self.pauses(since, until)]
        long = [f"{d:.1f}s" for d in spans if d >= 1.0]
        short = [d for d in spans if d < 1.0]
        if not spans:
            return ""
        rest = f"{len(short)} shorter, {sum(short):.1f}s in all" if short else ""
        if not long:
            return f"; the machine paused under 1s each time ({rest})"
        return f"; the machine paused {', '.join(long)}" + (f" (and {rest})" if rest else "")


async def within(aw: Awaitable[T], limit_s: float, started: float, pauses: Pauses | None) -> T:
    """``aw``'s result, or ``TimeoutError`` once ``limit_s`` seconds of running time have
    passed since ``started`` (a ``time.monotonic()`` reading): wall time less the machine's
    pauses in it. ``aw`` is cancelled on the timeout."""
    task = asyncio.ensure_future(aw)
    seen, grace = -1.0, False
    try:
        while True:
            now = time.monotonic()
            extra = pauses.paused_s(started, now) if pauses is not None else 0.0
            if extra > seen:
                seen, grace = extra, pauses is not None
            left = started + limit_s + extra - now
            if left <= 0:
                if not grace:
                    raise TimeoutError
                # a pause that just ended is written down by the watchers a tick after this
                # process runs again: look once more before calling it a timeout
                grace, left = False, 0.25
            done, _ = await asyncio.wait({task}, timeout=left)
            if done:
                return task.result()
    finally:
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
