"""Push-overlap bookkeeping: the share of P's writes hidden behind its compute, reported in the
``done`` event's detail."""

from __future__ import annotations

import time
from typing import Any

import pytest

from connector.worker.overlap import overlap, parse
from metaserver.models import BindingState
from tests.connector import cluster as C


def test_overlap_writes_before_compute_end_are_hidden() -> None:
    o = overlap([(1.0, 2.0), (3.0, 4.0)], compute_end=5.0, ended_at=5.5)
    assert o.push_s == pytest.approx(2.0)
    assert o.exposed_s == 0.0
    assert o.hidden == 1.0
    assert o.tail_s == pytest.approx(0.5)


def test_overlap_counts_only_the_part_of_a_write_after_compute_end() -> None:
    o = overlap([(1.0, 2.0), (4.0, 6.0)], compute_end=5.0, ended_at=6.25)
    assert o.push_s == pytest.approx(3.0)
    assert o.exposed_s == pytest.approx(1.0)
    assert o.hidden == pytest.approx(2.0 / 3.0)
    assert o.writes == 2


def test_overlap_message_round_trips_through_parse() -> None:
    o = overlap([(0.0, 0.5), (1.0, 2.0)], compute_end=1.5, ended_at=2.0)
    got = parse(o.message())
    assert got["push_s"] == pytest.approx(1.5)
    assert got["exposed_s"] == pytest.approx(0.5)
    assert got["hidden"] == pytest.approx(0.667, abs=1e-3)
    assert got["writes"] == 2
    assert parse(None) == {} and parse("no numbers here") == {}


def test_overlap_places_compute_end_on_the_wall_clock_when_the_offset_is_known() -> None:
    assert overlap([], 10.0, 11.0, wall_offset=1000.0).compute_end_at == pytest.approx(1010.0)
    assert overlap([], 10.0, 11.0).compute_end_at == 0.0


class _Events:
    def __init__(self) -> None:
        self.posted: list[tuple[str, BindingState, Any]] = []

    def post_event(self, tid: str, state: BindingState, actor: str, detail: Any = None) -> None:
        self.posted.append((tid, state, detail))

    def close(self, timeout: float) -> None:
        pass


def test_worker_done_event_reports_push_overlap() -> None:
    port = C.free_port_range(1)
    d = C.make_instance("d-eng", "kv_consumer", 1, port=port)
    p = C.make_instance("p-eng", "kv_producer", 1)
    events = _Events()
    p.workers[0]._events = events  # type: ignore[assignment]
    try:
        C.fill_prefill(p)
        C.expect(d, "dreq", "tov", [1, 2, 3])
        C.push(p, "preq", "tov", C.destination(d, port), [[(0, 1)], [(1, 2), (2, 3)]])
        C.poll(p, {"preq"}, lambda acc: "preq" in acc[0][0])
        C.poll(d, set(), lambda acc: "dreq" in acc[0][1])
        done = [e for e in events.posted if e[1] is BindingState.DONE]
        assert len(done) == 1 and done[0][0] == "tov"
        stats = parse(done[0][2].message)
        assert stats["writes"] >= 1
        assert stats["push_s"] > 0
        assert 0.0 <= stats["hidden"] <= 1.0
        assert 0.0 <= stats["exposed_s"] <= stats["push_s"] + 1e-9
        assert stats["tail_s"] >= 0.0
        assert abs(stats["p_end_at"] - time.time()) < 60  # a wall-clock time, not perf_counter
    finally:
        C.close(p, d)
