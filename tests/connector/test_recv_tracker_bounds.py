"""D's receive tracker holds bounded state and does bounded work per engine step.

Signals and keep-alives for transfers D does not expect (yet) are kept until D's deadline, in
case the request shows up late. Anyone who reaches an unsealed side channel (and any key holder
of a sealed one) could add such entries without end: one 2.7 MB ``Alive`` naming 300,000 made-up
transfers added ~1 s to every D engine step for two minutes, because ``poll`` (run every step)
scanned them all. Now at most ``MAX_EARLY`` are held (the oldest dropped, counted, logged once)
and ``poll`` touches only those whose time is up."""

from __future__ import annotations

import logging
import sys
from collections.abc import Callable
from types import FrameType
from typing import Any

import pytest

from connector import wire
from connector.worker import arrivals
from connector.worker.receiver import RecvTracker

MAX_EARLY = 4096  # transfers D holds early signals or keep-alives for


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _tids(n: int, prefix: str = "t") -> list[str]:
    return [f"{prefix}-{i}" for i in range(n)]


def _lines_run(call: Callable[[], Any]) -> int:
    """How many lines of Python ``call`` runs in connector code: the work it does, counted
    exactly (a timing would depend on the machine's load)."""
    count = 0

    def tracer(frame: FrameType, event: str, arg: object) -> Any:
        nonlocal count
        if "/connector/" in frame.f_code.co_filename:
            if event == "line":
                count += 1
            return tracer
        return None

    sys.settrace(tracer)
    try:
        call()
    finally:
        sys.settrace(None)
    return count


def test_early_entries_are_capped_oldest_first_counted_and_logged_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.WARNING, logger="pdgate")
    clock = Clock()
    tracker = RecvTracker(120.0, clock)
    flood = _tids(MAX_EARLY + 1000, "forged")
    tracker.on_alive(wire.Alive("evil/0", flood[:3000]))
    tracker.on_alive(wire.Alive("evil/0", flood[3000:]))
    for tid in _tids(10, "sig"):
        tracker.on_signal(wire.Signal(tid, "evil/0", True, 1))
    assert getattr(tracker, "early_dropped", None) == 1000 + 10
    assert arrivals.MAX_EARLY == MAX_EARLY and tracker.early_held() == MAX_EARLY
    dropped = [r for r in caplog.records if "dropped" in r.getMessage()]
    assert len(dropped) == 1
    # the newest are the ones kept: a request that shows up now finds its early signal
    tracker.expect("req", "sig-9")
    finished, failed = tracker.poll()
    assert finished == {"req"} and failed == set()
    # ... and a request whose early entry was dropped waits (for its deadline at worst)
    tracker.expect("old", "forged-0")
    assert tracker.poll() == (set(), set())


def test_expected_transfers_are_never_dropped_for_early_ones() -> None:
    tracker = RecvTracker(120.0, Clock())
    tracker.expect("req", "mine")
    tracker.on_alive(wire.Alive("p/0", ["mine"]))
    tracker.on_alive(wire.Alive("evil/0", _tids(2 * MAX_EARLY)))
    tracker.on_signal(wire.Signal("mine", "p/0", True, 1))
    assert tracker.poll() == ({"req"}, set())


def test_poll_work_does_not_grow_with_the_early_entries_held() -> None:
    clock = Clock()
    few, many = RecvTracker(120.0, clock), RecvTracker(120.0, clock)
    few.on_alive(wire.Alive("evil/0", _tids(10)))
    many.on_alive(wire.Alive("evil/0", _tids(MAX_EARLY)))
    for t in (few, many):
        t.expect("req", "waiting")  # one load in flight, as on a busy D
    clock.now += 1.0
    assert _lines_run(many.poll) == _lines_run(few.poll)
    # their deadline passed: each is dropped once, then no more work
    clock.now += 120.0
    many.poll()
    assert many.early_held() == 0
    clock.now += 1.0
    assert _lines_run(many.poll) <= _lines_run(few.poll)


def test_digests_ahead_of_signals_are_kept_for_so_many_senders_only() -> None:
    tracker = RecvTracker(120.0, Clock())
    tracker.expect("req", "mine")
    for i in range(3 * arrivals.MAX_SENDERS):
        tracker.on_digests(wire.Digests("mine", f"evil/{i}", [(0, 4096, 64, 7)]))
    assert tracker.digest_senders("mine") == arrivals.MAX_SENDERS
