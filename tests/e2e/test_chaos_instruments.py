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


def _wait_for_lines(watch: PauseWatch, cpus: list[int], timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while not all(watch.gaps(c) for c in cpus):
        assert time.monotonic() < deadline, "the watchers wrote no gap"
        time.sleep(0.02)


def test_pause_watch_counts_only_what_every_cpu_missed(tmp_path: Path) -> None:
    """The reading of the watchers' files, on gaps written here (no process, no clock)."""
    watch = PauseWatch(tmp_path)
    watch.cpus = [0, 1]
    # CPU 0 alone missed 10-13 (load on it, not a pause); both missed 20.0-21.5 and 30.0-30.4
    watch._file(0).write_text("10.0 13.0\n19.9 21.5\n30.0 30.6\n")
    watch._file(1).write_text("20.0 21.7\n29.8 30.4\n")
    assert watch.pauses() == [(20.0, 21.5), (30.0, 30.4)]
    assert watch.pauses(since=21.0, until=30.2) == [(21.0, 21.5), (30.0, 30.2)]
    assert watch.paused_s(0.0, 40.0) == pytest.approx(1.9)
    assert watch.cpu_stalls() == {0: pytest.approx(3.0), 1: pytest.approx(1.7)}
    assert watch.cpu_stalls(since=11.0, until=12.0) == {0: pytest.approx(1.0), 1: 0.0}
    assert watch.describe(0.0, 40.0) == "; the machine paused 1.5s (and 1 shorter, 0.4s in all)"
    short = "; the machine paused under 1s each time (1 shorter, 0.4s in all)"
    assert watch.describe(25.0, 40.0) == short
    assert watch.describe(0.0, 15.0) == ""


def test_pause_watch_sees_its_watchers_stopped(tmp_path: Path) -> None:
    """The live watchers: each one stopped alone shows as that CPU's stall, all stopped at once
    (what a paused VM looks like) as a pause. The machine may pause on its own meanwhile, so
    this looks for the pause it made rather than for the only one."""
    with PauseWatch(tmp_path, min_gap_s=0.3) as watch:
        watch.wait_ticking()  # a watcher stopped before its loop records nothing (a CI run)
        lone = watch.procs[0]
        since = time.monotonic()
        os.kill(lone.pid, signal.SIGSTOP)
        time.sleep(0.6)
        os.kill(lone.pid, signal.SIGCONT)
        _wait_for_lines(watch, watch.cpus[:1])
        assert watch.cpu_stalls(since=since)[watch.cpus[0]] >= 0.5
        for p in watch.procs:  # every watcher stopped at once
            os.kill(p.pid, signal.SIGSTOP)
        stopped = time.monotonic()
        time.sleep(PAUSE_S)
        resumed = time.monotonic()
        for p in watch.procs:
            os.kill(p.pid, signal.SIGCONT)
        deadline = time.monotonic() + 60  # the machine may pause meanwhile
        # (a watcher may still tick once between the signal's sending and its stop)
        while not any(lo <= stopped + 0.05 and resumed <= hi for lo, hi in watch.pauses()):
            assert time.monotonic() < deadline, (watch.pauses(), stopped, resumed)
            time.sleep(0.02)
    assert watch.paused_s(stopped, resumed) == pytest.approx(resumed - stopped, abs=0.05)
    assert "the machine paused" in watch.describe(stopped, resumed)


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
