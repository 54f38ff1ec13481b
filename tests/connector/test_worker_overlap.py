"""Push-overlap bookkeeping: the share of P's writes hidden behind its compute, reported in the
``done`` event's detail."""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest
import torch

from connector.worker.overlap import overlap
from pdwire.models import BindingState
from pdwire.push_summary import parse
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
        C.small_push(p, d, port, "tov")
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


class _Gate:
    """A device event double with the CUDA event's contract (``query`` never waits,
    ``synchronize`` waits): the layer's kernels finish when the test opens the gate."""

    def __init__(self) -> None:
        self.open = threading.Event()

    def query(self) -> bool:
        return self.open.is_set()

    def synchronize(self) -> None:
        assert self.open.wait(20), "a layer event was never completed"


class _GatedDevice:
    name = "gated"

    def __init__(self) -> None:
        self.events: list[_Gate] = []

    def record_event(self) -> _Gate:
        self.events.append(_Gate())
        return self.events[-1]

    def checksums(self, pieces: object) -> list[int]:
        raise AssertionError("verify_kv is off in this test")


def test_worker_sender_writes_finished_layers_before_waiting_on_an_unfinished_one() -> None:
    """On a device the forward queues every layer before the first one is computed: the
    sender must push the layers whose events completed instead of waiting for the rest."""
    port = C.free_port_range(1)
    d = C.make_instance("d-eng", "kv_consumer", 1, port=port)
    p = C.make_instance("p-eng", "kv_producer", 1)
    device = _GatedDevice()
    p.workers[0].device = device
    names = list(p.caches[0])
    try:
        C.fill_prefill(p)
        C.expect(d, "dreq", "tgate", [5, 6])
        C.push(p, "preq", "tgate", C.destination(d, port), [[(0, 5), (1, 6)]])
        assert len(device.events) == len(names)
        device.events[0].open.set()
        device.events[1].open.set()

        def landed(layer: str) -> bool:
            return bool(torch.equal(d.caches[0][layer][5:7], p.caches[0][layer][0:2]))

        deadline = time.monotonic() + 20
        while not (landed(names[0]) and landed(names[1])) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert landed(names[0]) and landed(names[1])
        assert not d.caches[0][names[2]].any()  # its kernels have not finished
        for gate in device.events[2:]:
            gate.open.set()
        C.poll(d, set(), lambda acc: "dreq" in acc[0][1])
        assert all(landed(name) for name in names)
    finally:
        for gate in device.events:
            gate.open.set()
        C.close(p, d)
