"""The chaos suite's own instruments (``tests/e2e/chaos.py``) that can be checked without a
deployment."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from tests.e2e.chaos import StallWatch
from tests.e2e.pauses import PauseWatch, overlap, within

STOPPED_S = 0.8
PAUSE_S = 1.2  # over a second: listed by name in a note


def test_stall_watch_measures_the_time_this_process_was_stopped() -> None:
    # the helper waits until this process is stopped, then continues it STOPPED_S later: the
    # stop lasts that long however slow the machine is between the two calls below
    pid = os.getpid()
    script = (
        f"while ! grep -q '^State:[[:space:]]*T' /proc/{pid}/status; do sleep 0.01; done; "
        f"sleep {STOPPED_S}; kill -CONT {pid}"
    )
    resume = subprocess.Popen(["sh", "-c", script])
    try:
        with StallWatch() as watch:
            os.kill(pid, signal.SIGSTOP)
    finally:
        resume.wait(30)
    assert STOPPED_S - 0.1 <= watch.worst_s < 30, watch.worst_s


def _wait_for_lines(watch: PauseWatch, cpus: list[int], timeout_s: float = 10) -> None:
    deadline = time.monotonic() + timeout_s
    while not all(watch.gaps(c) for c in cpus):
        assert time.monotonic() < deadline, "the watchers wrote no gap"
        time.sleep(0.02)


def test_pause_watch_counts_only_what_every_cpu_missed(tmp_path: Path) -> None:
    with PauseWatch(tmp_path, min_gap_s=0.3) as watch:
        time.sleep(0.2)
        if len(watch.procs) > 1:  # one CPU's watcher stopped alone: load, not a pause
            os.kill(watch.procs[0].pid, signal.SIGSTOP)
            time.sleep(0.6)
            os.kill(watch.procs[0].pid, signal.SIGCONT)
            _wait_for_lines(watch, watch.cpus[:1])
            assert watch.pauses() == []
        stopped = time.monotonic()
        for p in watch.procs:  # every watcher stopped at once: what a paused VM looks like
            os.kill(p.pid, signal.SIGSTOP)
        time.sleep(PAUSE_S)
        for p in watch.procs:
            os.kill(p.pid, signal.SIGCONT)
        resumed = time.monotonic()
        _wait_for_lines(watch, watch.cpus)
        while not watch.pauses(since=stopped):
            time.sleep(0.02)
        (lo, hi), *rest = watch.pauses(since=stopped)
    assert rest == []
    assert stopped - 0.1 <= lo and hi <= resumed + 0.1, (lo, hi, stopped, resumed)
    assert PAUSE_S - 0.1 <= hi - lo <= resumed - stopped + 0.1
    assert watch.paused_s(lo + 0.2, hi) == pytest.approx(hi - lo - 0.2)
    assert watch.describe(stopped, resumed + 1) == f"; the machine paused {hi - lo:.1f}s"
    assert "under 1s each time (1 shorter" in watch.describe(stopped, lo + 0.5)
    assert watch.describe(resumed + 1, resumed + 2) == ""


def test_overlap_keeps_what_both_lists_cover() -> None:
    a = [(0.0, 2.0), (5.0, 9.0)]
    b = [(1.0, 6.0), (8.0, 8.5), (10.0, 11.0)]
    assert overlap(a, b) == [(1.0, 2.0), (5.0, 6.0), (8.0, 8.5)]
    assert overlap(a, []) == []


class _Paused:
    def __init__(self, seconds: float) -> None:
        self.seconds = seconds

    def paused_s(self, since: float, until: float) -> float:
        return self.seconds


async def test_within_bounds_running_time_not_wall_time() -> None:
    async def slow(seconds: float = 0.6) -> str:
        await asyncio.sleep(seconds)
        return "done"

    # 0.6 s of wall time against a 0.3 s bound: too long, unless the machine paused 0.5 s of it
    assert await within(slow(), 0.3, time.monotonic(), _Paused(0.5)) == "done"
    started = time.monotonic()
    with pytest.raises(TimeoutError):
        await within(slow(), 0.3, started, None)
    assert time.monotonic() - started < 0.5
    with pytest.raises(TimeoutError):  # no pause: the bound, plus one look after a tick
        await within(slow(1.0), 0.3, time.monotonic(), _Paused(0.0))
