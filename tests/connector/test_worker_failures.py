"""Failure paths of the worker halves: each ends with blocks released and no hung request."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

import msgspec
import pytest
import torch

from connector import tp, wire
from connector.metadata import Abandoned, PdgateMetadata, RecvEntry, SendChunk
from connector.transport import InProcessTransport
from connector.transport.mooncake import session_problem as mooncake_session_problem
from connector.worker.keepalive import KeepAlive
from connector.worker.ledger import Ledger
from connector.worker.receiver import RecvTracker
from connector.worker.side_channel import SideChannelServer, handshake
from pdwire.models import BindingState
from pdwire.version import PROTOCOL_VERSION
from tests.connector import cluster as C
from tests.connector.test_worker_overlap import _Events
from tests.support.procs import until


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _sig(tid: str, sender: str, ok: bool = True, expected: int = 1) -> wire.Signal:
    return wire.Signal(tid, sender, ok, expected, "" if ok else "boom")


def test_receiver_early_signal_is_buffered_until_the_request_is_known() -> None:
    t = RecvTracker(10.0, FakeClock())
    t.on_signal(_sig("t1", "p/0"))
    assert t.poll() == (set(), set())
    t.expect("r1", "t1")
    assert t.poll() == ({"r1"}, set())


def test_receiver_duplicate_signal_counts_once() -> None:
    t = RecvTracker(10.0, FakeClock())
    t.expect("r1", "t1")
    t.on_signal(_sig("t1", "p/0", expected=2))
    t.on_signal(_sig("t1", "p/0", expected=2))
    assert t.poll() == (set(), set()) and t.ignored_signals == 1
    t.on_signal(_sig("t1", "p/1", expected=2))
    assert t.poll() == ({"r1"}, set())


def test_receiver_late_signal_of_an_old_attempt_never_completes_a_new_one() -> None:
    clock = FakeClock()
    t = RecvTracker(5.0, clock)
    t.expect("r1", "attempt-1")
    clock.now += 6
    assert t.poll() == ({"r1"}, {"r1"})  # expired
    t.on_signal(_sig("attempt-1", "p/0"))  # late: ignored
    t.expect("r1", "attempt-2")  # the retry of the same request, new transfer id
    assert t.poll() == (set(), set())
    assert t.ignored_signals == 1
    t.expect("r2", "attempt-1")  # a stale transfer id is never waited on again
    assert t.pending() == 1


def test_receiver_deadline_turns_silence_into_a_failed_load() -> None:
    clock = FakeClock()
    t = RecvTracker(120.0, clock)
    t.expect("r1", "t1")
    clock.now += 119.9
    assert t.poll() == (set(), set())
    clock.now += 0.2
    assert t.poll() == ({"r1"}, {"r1"}) and t.expired == 1


def test_receiver_aborted_request_waits_for_p_or_deadline_then_releases_without_failure() -> None:
    clock = FakeClock()
    t = RecvTracker(30.0, clock)
    t.expect("r1", "t1")
    t.expect("r2", "t2")
    t.aborted({"r1", "r2"})
    assert t.poll() == (set(), set())  # P may still be writing these blocks
    t.on_signal(_sig("t1", "p/0", ok=False))  # P confirms it stopped
    assert t.poll() == ({"r1"}, set())
    clock.now += 31
    assert t.poll() == ({"r2"}, set())


def test_receiver_reports_when_each_intact_load_was_ready() -> None:
    wall = FakeClock()
    t = RecvTracker(30.0, FakeClock(), wall=wall)
    for req, tid in (("r1", "t1"), ("r2", "t2"), ("r3", "t3")):
        t.expect(req, tid)
    t.on_signal(_sig("t1", "p/0", expected=2))
    wall.now += 0.5
    t.on_signal(_sig("t1", "p/1", expected=2))  # the last rank's signal makes it ready
    t.on_signal(_sig("t2", "p/0", ok=False))  # failed: never ready
    t.aborted({"r3"})
    t.on_signal(_sig("t3", "p/0"))  # landed, but nobody waits for it any more
    wall.now += 2.0  # the poll comes later: the wait is timed from the signal
    assert t.poll() == ({"r1", "r2", "r3"}, {"r2"})
    assert t.take_ready() == {"r1": 1000.5}
    assert t.take_ready() == {}  # handed over once


def test_receiver_load_that_landed_after_its_signal_is_ready_when_found_intact() -> None:
    wall = FakeClock()
    t = RecvTracker(30.0, FakeClock(), wall=wall)
    landed = iter(["piece 0 does not match", ""])
    t.verify = lambda sig: next(landed)
    t.expect("r1", "t1")
    t.on_signal(wire.Signal("t1", "p/0", True, 1, digests=[(0, 4096, 64, 1)]))
    assert t.poll() == (set(), set()) and t.take_ready() == {}  # bytes still on their way
    wall.now += 0.25
    assert t.poll() == ({"r1"}, set())
    assert t.take_ready() == {"r1": 1000.25}


def test_receiver_releases_an_aborted_load_p_never_took_at_once() -> None:
    t = RecvTracker(30.0, FakeClock())
    t.expect("r1", "t1")
    t.expect("r2", "t2")
    t.release(["r1", "unknown"])  # the scheduler won bound → aborted for t1
    assert t.poll() == ({"r1"}, set())  # finished, not failed: the request is gone anyway
    t.on_signal(_sig("t1", "p/0"))  # nothing can come, and if it did it is ignored
    assert t.poll() == (set(), set()) and t.ignored_signals == 1
    assert t.pending() == 1


def test_receiver_fails_a_load_whose_p_went_silent_and_asks_to_quarantine_it() -> None:
    clock = FakeClock()
    t = RecvTracker(30.0, clock, silence_s=3.0)
    t.expect("r1", "t1")
    t.expect("r2", "t2")  # P never started this one: only the deadline can end it
    t.on_alive(wire.Alive("p/0", ["t1"]))
    clock.now += 2.9
    assert t.poll() == (set(), set())
    t.on_alive(wire.Alive("p/0", ["t1"]))  # still alive
    clock.now += 2.9
    assert t.poll() == (set(), set()) and t.take_silent() == set()
    clock.now += 0.2  # 3.1 s without a word: killed or frozen
    assert t.poll() == ({"r1"}, {"r1"}) and t.silent == 1
    assert t.take_silent() == {"r1"} and t.take_silent() == set()
    t.on_alive(wire.Alive("p/0", ["t1"]))  # a late keep-alive of a retired transfer
    assert t.pending() == 1 and t.poll() == (set(), set())
    clock.now += 30
    assert t.poll() == ({"r2"}, {"r2"}) and t.take_silent() == set()


def test_receiver_quarantines_a_load_failed_at_the_deadline_while_p_was_pushing() -> None:
    # before: only silence quarantined; at the deadline the blocks went straight back to vLLM,
    # and a write P had in flight landed after D recomputed into them (wrong tokens in CI)
    clock = FakeClock()
    t = RecvTracker(30.0, clock)
    t.expect("r1", "t1")  # P is pushing: it keeps sending keep-alives
    t.expect("r2", "t2")  # one of P's two ranks signalled, the other did not
    t.expect("r3", "t3")  # P never said a word: nothing of it can land
    for _ in range(3):
        clock.now += 10
        t.on_alive(wire.Alive("p/0", ["t1"]))
    t.on_signal(_sig("t2", "p/0", expected=2))
    assert t.poll() == ({"r1", "r2", "r3"}, {"r1", "r2", "r3"}) and t.expired == 3
    assert t.take_silent() == {"r1", "r2"}


def test_receiver_names_the_p_rank_and_reason_of_a_failed_push(
    caplog: pytest.LogCaptureFixture,
) -> None:
    t = RecvTracker(30.0, FakeClock())
    t.expect("r1", "t1")
    t.on_signal(_sig("t1", "p/0", expected=2))
    t.on_signal(_sig("t1", "p/1", ok=False, expected=2))
    with caplog.at_level(logging.WARNING, logger="pdgate.connector"):
        assert t.poll() == ({"r1"}, {"r1"})
    said = [r.getMessage() for r in caplog.records if "failing the load" in r.getMessage()]
    # P's words quoted (review 2, N14: no forged log lines)
    assert said == [
        "transfer t1 (r1): P reported its push failed ('p/1': 'boom'); failing the load"
    ]


def test_receiver_keepalive_before_the_request_is_known_counts() -> None:
    clock = FakeClock()
    t = RecvTracker(30.0, clock, silence_s=3.0)
    t.on_alive(wire.Alive("p/0", ["t1"]))
    t.expect("r1", "t1")
    clock.now += 3.5
    assert t.poll() == ({"r1"}, {"r1"})


def test_receiver_silence_does_not_end_an_aborted_load_early() -> None:
    clock = FakeClock()
    t = RecvTracker(30.0, clock, silence_s=3.0)
    t.expect("r1", "t1")
    t.on_alive(wire.Alive("p/0", ["t1"]))
    t.aborted({"r1"})
    clock.now += 10  # nobody waits for this answer: P's signal or the deadline frees it
    assert t.poll() == (set(), set()) and t.take_silent() == set()
    clock.now += 21
    assert t.poll() == ({"r1"}, set())


def test_receiver_without_silence_waits_for_the_deadline() -> None:
    clock = FakeClock()
    t = RecvTracker(30.0, clock)
    t.expect("r1", "t1")
    t.on_alive(wire.Alive("p/0", ["t1"]))
    clock.now += 29
    assert t.poll() == (set(), set())


def test_sender_keepalive_names_open_transfers_to_each_d_rank() -> None:
    port = C.free_port_range(2)
    got: list[tuple[int, wire.Alive]] = []
    servers = [
        SideChannelServer(
            "127.0.0.1",
            port + r,
            lambda hello: wire.Refused("no"),
            lambda sig: None,
            lambda alive, r=r: got.append((r, alive)),  # type: ignore[misc]
        )
        for r in range(2)
    ]
    ledger = Ledger(lambda chunk: [tp.Route(int(chunk.req_id[-1]), 0, 4, 0, 1)])
    d = C.destination(C.Instance("d-eng", 2, 8, False, 32, 16, 32), port)
    for req in ("a0", "b0", "c1"):
        ledger.open(SendChunk(req, f"t-{req}", d, [], False))
    ledger.ended(ledger.transfers["b0"][0])  # signalled: no more keep-alives for it
    ka = KeepAlive("p-eng/0", ledger, interval_s=0.05)
    ka.start()
    try:
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline and {r for r, _ in got} != {0, 1}:
            time.sleep(0.02)
    finally:
        ka.stop()
        for s in servers:
            s.close()
    assert {(r, a.sender, tuple(a.transfer_ids)) for r, a in got} == {
        (0, "p-eng/0", ("t-a0",)),
        (1, "p-eng/0", ("t-c1",)),
    }


def test_sender_keepalive_announces_a_new_transfer_at_once() -> None:
    """D's silence clock starts at P's first keep-alive: a transfer opened between two beats
    is named at once, not an interval later (a P frozen meanwhile would only be caught by
    D's load deadline)."""
    port = C.free_port_range(1)
    got: list[wire.Alive] = []
    server = SideChannelServer(
        "127.0.0.1",
        port,
        lambda hello: wire.Refused("no"),
        lambda sig: None,
        lambda alive: got.append(alive),
    )
    ledger = Ledger(lambda chunk: [tp.Route(0, 0, 1, 0, 1)])
    d = C.destination(C.Instance("d-eng", 1, 8, False, 32, 16, 32), port)
    # an interval no test outlasts: any keep-alive that comes was sent for the opening
    ka = KeepAlive("p-eng/0", ledger, interval_s=3600.0)
    ka.start()
    try:
        time.sleep(0.2)  # the thread waits for its first interval
        ledger.open(SendChunk("r0", "t-r0", d, [], False))
        deadline = time.monotonic() + 60  # a hang guard, not a bound: it returns on arrival
        while time.monotonic() < deadline and not got:
            time.sleep(0.01)
    finally:
        ka.stop()
        server.close()
    assert got, "no keep-alive for the opened transfer"
    alive = got[0]
    assert alive.transfer_ids == ["t-r0"], alive
    assert ledger.on_open is None  # stopped: the ledger no longer pokes it


def test_worker_handshake_with_nobody_listening_fails_and_releases_p(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A refused connection (a D that is gone) fails the handshake at once, not at its
    timeout (2 s here): ZeroMQ alone would keep reconnecting until then."""
    caplog.set_level(logging.WARNING, logger="pdgate")
    port = C.free_port_range(1)
    p = C.make_instance("p-eng", "kv_producer", 1)
    try:
        C.fill_prefill(p)
        dest = C.destination(C.Instance("d-eng", 1, 8, False, 32, 16, 32), port)
        C.push(p, "preq", "tnobody", dest, [[(0, 1)]])
        C.poll(p, {"preq"}, lambda acc: "preq" in acc[0][0])
        sender = p.workers[0].sender
        assert sender is not None and sender.writes == 0
        failed = [r.getMessage() for r in caplog.records if "handshake with" in r.getMessage()]
        assert failed == [
            f"handshake with 127.0.0.1:{port} failed: 127.0.0.1:{port} refuses connections "
            "(no D side channel there)"
        ]
    finally:
        C.close(p)


def test_worker_handshake_refused_for_a_different_engine_fails_d_at_once() -> None:
    port = C.free_port_range(1)
    d = C.make_instance("d-eng", "kv_consumer", 1, port=port)
    p = C.make_instance("p-eng", "kv_producer", 1)
    try:
        C.fill_prefill(p)
        C.expect(d, "dreq", "tstale", [1])
        stale = C.destination(d, port)
        stale = type(stale)(
            **{**{f: getattr(stale, f) for f in stale.__slots__}, "engine_id": "old"}
        )
        C.push(p, "preq", "tstale", stale, [[(0, 1)]])
        C.poll(p, {"preq"}, lambda acc: "preq" in acc[0][0])
        got = C.poll(d, set(), lambda acc: "dreq" in acc[0][1])
        assert got[0][2] == {"dreq"}  # failed -> vLLM recomputes, long before the deadline
        assert not d.caches[0][C.LAYERS[0]].any()
    finally:
        C.close(p, d)


class NamesAnotherSession(InProcessTransport):
    """D's transport, naming in its Welcome the memory of a process on another machine."""

    def __init__(self, victim: InProcessTransport) -> None:
        super().__init__()
        self._victim = victim

    @property
    def session(self) -> str:
        return self._victim.session


def test_worker_refuses_a_d_naming_another_hosts_session() -> None:
    """P writes only into a session on the host it reached D's side channel at: a D (a
    compromised engine holding the side-channel key) cannot aim P's push at another machine's
    registered memory."""
    port = C.free_port_range(1)
    victim = InProcessTransport(host="10.9.9.9")
    d = C.make_instance("d-eng", "kv_consumer", 1, port=port,
                        transports=[NamesAnotherSession(victim)])  # fmt: skip
    p_transport = InProcessTransport()
    p = C.make_instance("p-eng", "kv_producer", 1, transports=[p_transport])
    try:
        C.fill_prefill(p)
        C.expect(d, "dreq", "tsess", [1])
        C.push(p, "preq", "tsess", C.destination(d, port), [[(0, 1)]])
        C.poll(p, {"preq"}, lambda acc: "preq" in acc[0][0])
        got = C.poll(d, set(), lambda acc: "dreq" in acc[0][1])
        assert got[0][2] == {"dreq"}  # D told the push failed: vLLM recomputes
        assert p_transport.calls == 0 and p_transport.bytes_written == 0
        assert victim.session_problem(victim.session, "10.9.9.9") is None
        assert "not one on 127.0.0.1" in (victim.session_problem(victim.session, "127.0.0.1") or "")
    finally:
        C.close(p, d)


def test_mooncake_session_must_be_on_the_host_p_reached() -> None:
    assert mooncake_session_problem("10.0.0.7:15123", "10.0.0.7") is None
    assert mooncake_session_problem("[fd00::7]:15123", "fd00::7") is None
    for named in ("10.0.0.8:15123", "10.0.0.7", "10.0.0.7:x", "evil:10.0.0.7"):
        assert mooncake_session_problem(named, "10.0.0.7") is not None, named


def test_worker_names_the_blocks_of_a_failed_load_without_d_prefix_hit() -> None:
    """vLLM before 0.32 hears of a failed load as block ids: the blocks the load was to fill,
    never D's own prefix-cache blocks (shared with other requests)."""
    port = C.free_port_range(1)
    d = C.make_instance("d-eng", "kv_consumer", 1, port=port)
    p = C.make_instance("p-eng", "kv_producer", 1)
    try:
        meta = PdgateMetadata(recvs=[RecvEntry("dreq", "tblk", [30, 31, 4, 5], load_from=2)])
        d.workers[0].start_step(meta)
        d.workers[0].end_step(meta)
        C.push(p, "preq", "tblk", C.destination(d, port), [[(0, 4), (1, 5)]], fail_last="boom")
        got = C.poll(d, set(), lambda acc: "dreq" in acc[0][1])
        assert got[0][2] == {"dreq"}
        assert d.workers[0].blocks_of({"dreq"}) == {4, 5}
    finally:
        C.close(p, d)


def test_worker_prefill_failing_mid_push_posts_failed_not_done() -> None:
    """P's request failing at its last chunk fails the transfer: D is told so, and the binding
    event says ``failed`` with the reason (it said ``done`` while D was told it failed)."""
    port = C.free_port_range(1)
    d = C.make_instance("d-eng", "kv_consumer", 1, port=port)
    p = C.make_instance("p-eng", "kv_producer", 1)
    events = _Events()
    p.workers[0]._events = events  # type: ignore[assignment]
    try:
        C.fill_prefill(p)
        C.expect(d, "dreq", "tpre", [4, 5])
        C.push(p, "preq", "tpre", C.destination(d, port), [[(0, 4), (1, 5)]], fail_last="boom")
        C.poll(p, {"preq"}, lambda acc: "preq" in acc[0][0])
        got = C.poll(d, set(), lambda acc: "dreq" in acc[0][1])
        assert got[0][2] == {"dreq"}
        assert [(tid, state) for tid, state, _ in events.posted][-1:] == [
            ("tpre", BindingState.FAILED)
        ]
        assert events.posted[-1][2].error == "boom"
    finally:
        C.close(p, d)


def _until(cond: Callable[[], bool], timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.01)


def test_worker_decoder_gone_mid_push_fails_the_transfer_on_both_sides() -> None:
    port = C.free_port_range(1)
    d = C.make_instance("d-eng", "kv_consumer", 1, port=port)
    p_transport = InProcessTransport()
    p = C.make_instance("p-eng", "kv_producer", 1, transports=[p_transport])
    try:
        full = C.fill_prefill(p)
        C.expect(d, "dreq", "tgone", [1, 2, 3])
        dest = C.destination(d, port)
        C.push(p, "preq", "tgone", dest, [[(0, 1)]], final=False)
        last_layer = d.caches[0][C.LAYERS[-1]]
        _until(lambda: torch.equal(last_layer[1], full[C.LAYERS[-1]][0]))
        p_transport.fail_writes_to.add(d.workers[0].transport.session)  # D's memory is gone
        C.push(p, "preq", "tgone", dest, [[(1, 2)], [(2, 3)]])
        sent = C.poll(p, {"preq"}, lambda acc: "preq" in acc[0][0])
        assert sent[0][0] == {"preq"}  # P's blocks released
        got = C.poll(d, set(), lambda acc: "dreq" in acc[0][1])
        assert got[0][2] == {"dreq"}  # D recomputes instead of waiting for the deadline
        assert not last_layer[3].any()
    finally:
        C.close(p, d)


def test_worker_prefill_abort_before_last_chunk_signals_failure() -> None:
    port = C.free_port_range(1)
    d = C.make_instance("d-eng", "kv_consumer", 1, port=port)
    p = C.make_instance("p-eng", "kv_producer", 1)
    try:
        C.fill_prefill(p)
        C.expect(d, "dreq", "tpabort", [1, 2])
        C.push(p, "preq", "tpabort", C.destination(d, port), [[(0, 1)]], final=False)
        sent = C.poll(p, {"preq"}, lambda acc: "preq" in acc[0][0])  # P request ended early
        assert sent[0][0] == {"preq"}
        got = C.poll(d, set(), lambda acc: "dreq" in acc[0][1])
        assert got[0][2] == {"dreq"}
    finally:
        C.close(p, d)


@pytest.mark.parametrize("d_aborted", [False, True], ids=["d-waiting", "d-aborted"])
def test_worker_lease_closed_before_any_chunk_ends_ds_load_at_once(d_aborted: bool) -> None:
    """P's scheduler hands over a lease whose request vLLM dropped before any chunk went out.
    D's load fails at once (a waiting request recomputes), or, D's request already aborted,
    its blocks are released without a failure. P reports nothing to vLLM (it holds no such
    request) and forgets the transfer once the signal went out."""
    port = C.free_port_range(1)
    # D's load deadline (600 s) lies far past poll's 20 s: only P's signal can end the load
    d = C.make_instance("d-eng", "kv_consumer", 1, port=port, timeout_s=600.0)
    p = C.make_instance("p-eng", "kv_producer", 1)
    try:
        C.fill_prefill(p)
        C.expect(d, "dreq", "tlease", [1, 2])
        if d_aborted:
            assert d.workers[0].transfer_results({"dreq"}) == (set(), set(), set())
        meta = PdgateMetadata(abandoned=[Abandoned("tlease", C.destination(d, port))])
        worker = p.workers[0]
        worker.start_step(meta)
        worker.end_step(meta)
        got = C.poll(d, set(), lambda acc: "dreq" in acc[0][1])
        assert got[0][2] == (set() if d_aborted else {"dreq"})
        sender = worker.sender
        assert sender is not None
        until(lambda: not worker.transfer_results(set())[0] and not sender.transfers)
    finally:
        C.close(p, d)


def test_worker_decode_abort_holds_blocks_until_p_confirms() -> None:
    port = C.free_port_range(1)
    d = C.make_instance("d-eng", "kv_consumer", 1, port=port)
    p = C.make_instance("p-eng", "kv_producer", 1)
    try:
        C.fill_prefill(p)
        C.expect(d, "dreq", "tdabort", [1, 2])
        for _ in range(3):
            assert d.workers[0].transfer_results({"dreq"}) == (set(), set(), set())
        C.push(p, "preq", "tdabort", C.destination(d, port), [[(0, 1), (1, 2)]])
        got = C.poll(d, set(), lambda acc: "dreq" in acc[0][1])
        assert got[0][2] == set()  # released (not a load failure: the request is gone)
        C.poll(p, {"preq"}, lambda acc: "preq" in acc[0][0])
    finally:
        C.close(p, d)


def test_worker_waits_for_handshake_in_background_and_redoes_it_after_restart() -> None:
    port = C.free_port_range(1)
    d = C.make_instance("d-eng", "kv_consumer", 1, port=port)
    p = C.make_instance("p-eng", "kv_producer", 1)
    gate = threading.Event()
    try:
        full = C.fill_prefill(p)
        sender = p.workers[0].sender
        assert sender is not None

        def slow(host: str, port_: int, hello: wire.Hello, timeout: float) -> wire.Welcome:
            gate.wait(10)
            return handshake(host, port_, hello, timeout, channel=p.workers[0].channel)

        sender.handshakes._ask = slow
        C.expect(d, "dreq", "tslow", [4])
        C.push(p, "preq", "tslow", C.destination(d, port), [[(0, 4)]])  # returns: not blocked
        assert not d.caches[0][C.LAYERS[0]].any()
        assert not sender.settled("preq")
        gate.set()
        C.poll(d, set(), lambda acc: "dreq" in acc[0][1])
        assert torch.equal(d.caches[0][C.LAYERS[0]][4], full[C.LAYERS[0]][0])
        C.poll(p, {"preq"}, lambda acc: "preq" in acc[0][0])
        assert sender.handshakes.count == 1
        C.close(d)  # D restarts on the same port with a new engine id
        d2 = C.make_instance("d-eng-2", "kv_consumer", 1, port=port)
        try:
            C.expect(d2, "dreq2", "tnew", [6])
            C.push(p, "preq2", "tnew", C.destination(d2, port), [[(1, 6)]])
            C.poll(d2, set(), lambda acc: "dreq2" in acc[0][1])
            assert torch.equal(d2.caches[0][C.LAYERS[2]][6], full[C.LAYERS[2]][1])
            assert sender.handshakes.count == 2
        finally:
            C.close(d2)
    finally:
        gate.set()
        C.close(p, d)


def test_worker_push_deadline_passed_writes_nothing_and_fails_d() -> None:
    port = C.free_port_range(1)
    d = C.make_instance("d-eng", "kv_consumer", 1, port=port)
    p = C.make_instance("p-eng", "kv_producer", 1)
    try:
        C.fill_prefill(p)
        C.expect(d, "dreq", "tlate", [1, 2])
        dest = C.destination(d, port)
        late = type(dest)(**{**{f: getattr(dest, f) for f in dest.__slots__}, "deadline": 1.0})
        C.push(p, "preq", "tlate", late, [[(0, 1), (1, 2)]])
        C.poll(p, {"preq"}, lambda acc: "preq" in acc[0][0])
        got = C.poll(d, set(), lambda acc: "dreq" in acc[0][1])
        assert got[0][2] == {"dreq"}
        assert not d.caches[0][C.LAYERS[0]].any()
    finally:
        C.close(p, d)


def test_worker_failed_handshake_is_retried_after_a_pause() -> None:
    port = C.free_port_range(1)
    p = C.make_instance("p-eng", "kv_producer", 1)
    d: C.Instance | None = None
    try:
        full = C.fill_prefill(p)
        sender = p.workers[0].sender
        assert sender is not None
        sender.handshakes.retry_after_s = 0.2
        ghost = C.destination(C.Instance("d-eng", 1, 8, False, 32, 16, 32), port)
        C.push(p, "preq", "tfirst", ghost, [[(0, 1)]])  # nobody listens yet
        C.poll(p, {"preq"}, lambda acc: "preq" in acc[0][0])
        d = C.make_instance("d-eng", "kv_consumer", 1, port=port)  # D comes up
        time.sleep(0.3)
        C.expect(d, "dreq", "tsecond", [1])
        C.push(p, "preq2", "tsecond", C.destination(d, port), [[(0, 1)]])
        got = C.poll(d, set(), lambda acc: "dreq" in acc[0][1])
        assert got[0][2] == set()
        assert torch.equal(d.caches[0][C.LAYERS[1]][1], full[C.LAYERS[1]][0])
    finally:
        C.close(p, *([d] if d else []))


class _OldWelcome(msgspec.Struct, tag="welcome"):
    """The Welcome of pdgate protocol 1 (before layouts were read from strides)."""

    engine_id: str
    epoch: str
    tp_rank: int
    tp_size: int
    session: str
    layer_names: list[str]
    layer_bases: list[list[int]]
    layout: dict[str, int]


@pytest.mark.parametrize("who", ["old-d", "new-p"])
def test_worker_peers_of_another_protocol_refuse_each_other_at_the_handshake(
    who: str, caplog: pytest.LogCaptureFixture
) -> None:
    """A D of an older release (its Welcome says protocol 1) or a P of a newer one (its Hello
    says 3): one line in each log names both versions, nothing is written, D fails the load."""
    port = C.free_port_range(1)
    d = C.make_instance("d-eng", "kv_consumer", 1, port=port)
    p = C.make_instance("p-eng", "kv_producer", 1)
    sender = p.workers[0].sender
    assert sender is not None
    if who == "old-d":  # the first release's Welcome: no protocol field, one ``layout``
        server = d.workers[0].server
        assert server is not None
        server._welcome = lambda hello: _OldWelcome("d-eng", "e", 0, 1, "s", [], [], {})  # type: ignore[assignment,return-value]
    else:
        sender.handshakes._hello = wire.Hello("p-eng", PROTOCOL_VERSION + 1)
    try:
        C.fill_prefill(p)
        C.expect(d, "dreq", "tproto", [1])
        with caplog.at_level(logging.WARNING, logger="pdgate.connector"):
            C.push(p, "preq", "tproto", C.destination(d, port), [[(0, 1)]])
            got = C.poll(d, set(), lambda acc: "dreq" in acc[0][1])
        assert got[0][2] == {"dreq"}
        assert not d.caches[0][C.LAYERS[0]].any()
        lines = [
            r.getMessage() for r in caplog.records if "protocol version mismatch" in r.getMessage()
        ]
        on_p = [m for m in lines if m.startswith("handshake with 127.0.0.1")]
        assert on_p, lines
        if who == "old-d":
            expected = f"speaks pdgate protocol 1, this side {PROTOCOL_VERSION}"
            assert f"D at 127.0.0.1:{port} {expected}" in on_p[0]
        else:
            on_d = [m for m in lines if m.startswith("rank 0 refuses a handshake")]
            newer = PROTOCOL_VERSION + 1
            expected = f"'p-eng' speaks pdgate protocol {newer}, this side {PROTOCOL_VERSION}"
            assert on_d and f"P engine {expected}" in on_d[0]  # P's engine id quoted (N14)
    finally:
        C.close(p, d)


@pytest.mark.parametrize("keepalive_s", [0.5, 0.0])
def test_sender_names_a_transfer_to_d_at_its_first_write(
    keepalive_s: float, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With keep-alives on, the sender thread sends D an ``Alive`` for a transfer as its first
    write lands (before the ``pushing`` event), whatever the keep-alive thread does: here it
    is stopped. With keep-alives off, nothing: D would read the missing beats as silence."""
    heard: list[str] = []
    on_alive = RecvTracker.on_alive

    def record(self: RecvTracker, alive: wire.Alive) -> None:
        heard.extend(alive.transfer_ids)
        on_alive(self, alive)

    monkeypatch.setattr(RecvTracker, "on_alive", record)
    port = C.free_port_range(1)
    d = C.make_instance("d-eng", "kv_consumer", 1, port=port)
    p = C.make_instance("p-eng", "kv_producer", 1)
    w = p.workers[0]
    assert w.sender is not None
    w.sender.keepalive.stop()  # its poke and beats: out of the picture
    w.sender._loop._recorder._announce = keepalive_s > 0  # what SenderOptions.keepalive_s sets
    events = _Events()
    w._events = events  # type: ignore[assignment]
    try:
        C.small_push(p, d, port, "tfw")
        assert [e[1] for e in events.posted][:1] == [BindingState.PUSHING]
        assert heard == (["tfw"] if keepalive_s else []), heard
    finally:
        C.close(p, d)
