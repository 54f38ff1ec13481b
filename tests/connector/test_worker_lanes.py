"""P's writes go out through one lane per D session: a D that stops answering mid-push (frozen,
its write waiting for Mooncake's 10 s deadline) holds only its own transfers. A proxy that gives
up on that D retries the request on another D, usually from the same P: that push must not wait
behind the frozen one (it did while all writes shared the sender thread; a CI run saw all three
of a request's attempts time out that way).

A lane also skips the writes that can no longer help: those of a transfer whose earlier write
failed in it, and those whose D load deadline passed while they waited."""

from __future__ import annotations

import threading
import time

import torch

from connector.errors import TransferError
from connector.metadata import Destination
from connector.tp import Route
from connector.transport import InProcessTransport
from connector.worker.batch import Part, Pieces, Write
from connector.worker.lanes import Lanes, Written
from connector.worker.transfer import LayerTask, Transfer
from connector.worker.writer import RetryingWriter
from tests.connector import cluster as C

PAIRS_1 = [(0, 4), (1, 5)]
PAIRS_2 = [(2, 7), (3, 8), (4, 9)]


class HoldsOneSession(InProcessTransport):
    """Writes into ``held`` wait for ``release`` (the D behind it is frozen)."""

    def __init__(self) -> None:
        super().__init__()
        self.held = ""
        self.entered = threading.Event()
        self.release = threading.Event()

    def write(self, session: str, src: list[int], dst: list[int], lengths: list[int]) -> None:
        if session == self.held:
            self.entered.set()
            assert self.release.wait(30.0)
        super().write(session, src, dst, lengths)


def _same_kv(p: C.Instance, d: C.Instance, pairs: list[tuple[int, int]]) -> None:
    for name in C.LAYERS:
        for pb, db in pairs:
            assert torch.equal(d.caches[0][name][db], p.caches[0][name][pb]), (name, pb, db)


def test_worker_a_frozen_d_does_not_hold_the_push_to_another_d() -> None:
    transport = HoldsOneSession()
    port_1 = C.free_port_range(2)
    port_2 = port_1 + 1
    frozen = C.make_instance("d-frozen", "kv_consumer", 1, port=port_1)
    other = C.make_instance("d-other", "kv_consumer", 1, port=port_2)
    p = C.make_instance("p-eng", "kv_producer", 1, transports=[transport])
    try:
        transport.held = frozen.workers[0].transport.session
        C.fill_prefill(p, seed=5)
        C.expect(frozen, "dreq-1", "t-1", [b for _, b in PAIRS_1])
        C.expect(other, "dreq-2", "t-2", [b for _, b in PAIRS_2])
        C.push(p, "preq-1", "t-1", C.destination(frozen, port_1), [PAIRS_1])
        assert transport.entered.wait(10.0), "the write into the frozen D never started"
        C.push(p, "preq-2", "t-2", C.destination(other, port_2), [PAIRS_2])
        got = C.poll(other, set(), lambda acc: "dreq-2" in acc[0][1], timeout=10.0)
        assert got[0][2] == set()  # loaded, not failed
        _same_kv(p, other, PAIRS_2)
        sender = p.workers[0].sender
        assert sender is not None
        held = sender.transfers["preq-1"][0]
        assert not held.ended and held.writing > 0  # D is not told "done" before the bytes
        transport.release.set()
        got = C.poll(frozen, set(), lambda acc: "dreq-1" in acc[0][1], timeout=10.0)
        assert got[0][2] == set()
        _same_kv(p, frozen, PAIRS_1)
    finally:
        transport.release.set()
        C.close(p, frozen, other)


class Calls:
    """A transport double whose writes fail while ``failing``; counts the attempts."""

    def __init__(self) -> None:
        self.failing = True
        self.calls: list[str] = []

    @property
    def late_landing_s(self) -> float:
        return 0.0

    def write(self, session: str, src: list[int], dst: list[int], lengths: list[int]) -> None:
        self.calls.append(session)
        if self.failing:
            raise TransferError(f"write to {session} failed (-1)")


class _Done:
    def synchronize(self) -> None: ...

    def query(self) -> bool:
        return True


def _write(session: str, tr: Transfer) -> Write:
    w = Write(session)
    w.add(Part(LayerTask(tr, [(0, 0)], 0, _Done()), 0, Pieces([0], [0], [16])))
    return w


def _transfer(tid: str, deadline: float = 0.0) -> Transfer:
    dest = Destination("dec", "d-eng", "127.0.0.1", 1, 1, 8, False, 16, deadline)
    return Transfer("req-" + tid, tid, dest, Route(0, 0, 8, 0, 1), [])


def _lanes(transport: Calls, now: float = 1000.0) -> tuple[Lanes, list[Written], threading.Event]:
    got: list[Written] = []
    reported = threading.Event()

    def done(w: Written) -> None:
        got.append(w)
        reported.set()

    writer = RetryingWriter(transport, retries=0)  # type: ignore[arg-type]
    return Lanes(writer, done, lambda: now), got, reported


def _wait(got: list[Written], n: int) -> None:
    deadline = time.monotonic() + 5.0
    while len(got) < n:
        assert time.monotonic() < deadline, got
        time.sleep(0.005)


def test_lane_skips_the_later_writes_of_a_transfer_whose_write_failed() -> None:
    transport = Calls()
    lanes, got, _ = _lanes(transport)
    broken, healthy = _transfer("t-broken"), _transfer("t-healthy")
    try:
        lanes.submit(_write("s1", broken))
        _wait(got, 1)
        transport.failing = False
        lanes.submit(_write("s1", broken))  # not attempted: the transfer has failed
        lanes.submit(_write("s1", healthy))
        _wait(got, 3)
    finally:
        lanes.stop(2.0)
    assert transport.calls == ["s1", "s1"]
    first, skipped, written = got
    assert first.error is not None and not first.dropped
    assert skipped.dropped and "earlier write of this transfer failed" in str(skipped.error)
    assert written.error is None and written.write.parts[0].task.transfer is healthy


def test_lane_drops_parts_whose_deadline_passed_and_writes_the_rest() -> None:
    transport = Calls()
    transport.failing = False
    lanes, got, _ = _lanes(transport, now=1000.0)
    late, timely = _transfer("t-late", deadline=999.0), _transfer("t-timely", deadline=1001.0)
    w = _write("s1", late)
    for part in _write("s1", timely).parts:
        w.add(part)
    try:
        lanes.submit(w)
        _wait(got, 2)
    finally:
        lanes.stop(2.0)
    dropped, written = got
    assert dropped.dropped and [p.task.transfer for p in dropped.write.parts] == [late]
    assert "deadline passed" in str(dropped.error)
    assert written.error is None and [p.task.transfer for p in written.write.parts] == [timely]
    assert len(transport.calls) == 1


def test_lanes_run_one_per_session_and_retire_when_idle() -> None:
    transport = Calls()
    transport.failing = False
    got: list[Written] = []
    writer = RetryingWriter(transport, retries=0)  # type: ignore[arg-type]
    lanes = Lanes(writer, got.append, lambda: 0.0, idle_s=0.2)
    try:
        lanes.submit(_write("s1", _transfer("a")))
        lanes.submit(_write("s2", _transfer("b")))
        assert lanes.busy() == 2
        _wait(got, 2)
        deadline = time.monotonic() + 5.0
        while lanes.busy():
            assert time.monotonic() < deadline, "idle lanes never retired"
            time.sleep(0.02)
        lanes.submit(_write("s1", _transfer("c")))  # a new lane for a session written again
        _wait(got, 3)
    finally:
        lanes.stop(2.0)
    assert sorted(transport.calls) == ["s1", "s1", "s2"]
