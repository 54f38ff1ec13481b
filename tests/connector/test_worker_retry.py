"""A write that fails once (a stalled Mooncake tcp lane hitting its deadline) is retried by P's
sender; the transfer then completes with exactly P's KV in D's blocks instead of making D
recompute the whole prompt. With retries off, the same fault fails the transfer on both sides.

Either way the failed attempt's pieces may still land later (Mooncake abandons a timed-out
write, it does not cancel it), so D holds the blocks for the transport's ``late_landing_s``
before decoding from them or freeing them. P keeps its source blocks as long only when the
retry succeeded (D decodes from the blocks the abandoned write may still reach); a failed
transfer's are released at once. A D that is gone (its side channel refuses connections)
gets no retry."""

from __future__ import annotations

import logging
import time

import pytest
import torch

from connector.errors import TransferError
from connector.transport import InProcessTransport
from tests.connector import cluster as C

PAIRS = [(0, 4), (1, 5), (2, 9)]


LATE_S = 0.6


class FailsOnce(InProcessTransport):
    """The first write fails after landing half its pieces (a lane that stalled mid-batch)."""

    def __init__(self) -> None:
        super().__init__()
        self.failures = 0

    @property
    def late_landing_s(self) -> float:
        return LATE_S

    def write(self, session: str, src: list[int], dst: list[int], lengths: list[int]) -> None:
        if self.failures == 0:
            self.failures += 1
            half = len(src) // 2
            super().write(session, src[:half], dst[:half], lengths[:half])
            raise TransferError(f"mooncake write to {session} failed (-1)")
        super().write(session, src, dst, lengths)


def _push(
    monkeypatch: pytest.MonkeyPatch, retries: int, transport: InProcessTransport | None = None
) -> tuple[C.Instance, C.Instance, set[str], float]:
    """Push; returns P, D, D's failed loads and how long after P's signal D reported. Right
    after the signal, P has released its blocks when the transfer failed, and holds them
    when it succeeded after a failed write."""
    monkeypatch.setenv("PDGATE_CONNECTOR_WRITE_RETRIES", str(retries))
    port = C.free_port_range(1)
    d = C.make_instance("d-eng", "kv_consumer", 1, port=port)
    p = C.make_instance("p-eng", "kv_producer", 1, transports=[transport or FailsOnce()])
    C.fill_prefill(p, seed=11)
    C.expect(d, "dreq", "tretry", [b for _, b in PAIRS])
    C.push(p, "preq", "tretry", C.destination(d, port), [PAIRS[:2], PAIRS[2:]])
    sender = p.workers[0].sender
    assert sender is not None
    assert sender.wait_quiet("preq", 10.0)
    signalled = time.monotonic()
    failed = bool(sender.transfers["preq"][0].error)
    early, _, _ = p.workers[0].transfer_results({"preq"})
    assert early == ({"preq"} if failed else set())
    got = C.poll(d, set(), lambda acc: "dreq" in acc[0][1])
    return p, d, got[0][2], time.monotonic() - signalled


def test_worker_failed_write_is_retried_and_the_load_completes_exactly(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="pdgate")
    p, d, failed, waited = _push(monkeypatch, retries=1)
    try:
        assert failed == set()  # D's load succeeded: nothing to recompute
        assert waited >= LATE_S - 0.1  # ... once the failed attempt can no longer land
        for name in C.LAYERS:
            for pb, db in PAIRS:
                assert torch.equal(d.caches[0][name][db], p.caches[0][name][pb]), (name, pb)
        sender = p.workers[0].sender
        assert sender is not None and not sender.transfers["preq"][0].error
        sent = C.poll(p, set(), lambda acc: "preq" in acc[0][0])
        assert sent[0][0] == {"preq"}  # released once the settle time has passed
        retried = [r.getMessage() for r in caplog.records if "retry 1 of 1" in r.getMessage()]
        assert len(retried) == 1 and "failed (-1)" in retried[0]
    finally:
        C.close(p, d)


def test_worker_failed_write_without_retries_fails_the_transfer_on_both_sides(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="pdgate")
    p, d, failed, waited = _push(monkeypatch, retries=0)
    try:
        assert failed == {"dreq"}  # D recomputes ...
        assert waited >= LATE_S - 0.1  # ... in blocks the failed write can no longer reach
        # (P released its blocks at the signal, checked in _push: D holds its own)
        messages = [r.getMessage() for r in caplog.records]
        assert not any("; retry " in m for m in messages)
        assert any("transfer tretry" in m and "failed (-1)" in m for m in messages)
        assert any("holding its blocks" in m and "failing the load" in m for m in messages)
    finally:
        C.close(p, d)


class PeerDiesMidWrite(InProcessTransport):
    """D is killed while the first write is in flight: its side channel closes, the write
    fails (as Mooncake's does at its deadline)."""

    def __init__(self) -> None:
        super().__init__()
        self.d: C.Instance | None = None
        self.writes = 0

    @property
    def late_landing_s(self) -> float:
        return LATE_S

    def write(self, session: str, src: list[int], dst: list[int], lengths: list[int]) -> None:
        self.writes += 1
        if self.d is not None:
            for w in self.d.workers:
                w.shutdown()  # its side channel stops listening
            self.d = None
        raise TransferError(f"mooncake write to {session} failed (-1)")


def test_worker_write_to_a_d_that_is_gone_is_not_retried(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A retry to a D whose side channel refuses connections could only wait for the write
    deadline again (10 s with Mooncake), holding the sender thread and P's blocks: the
    transfer fails at once and P releases its blocks."""
    caplog.set_level(logging.WARNING, logger="pdgate")
    monkeypatch.setenv("PDGATE_CONNECTOR_WRITE_RETRIES", "1")
    port = C.free_port_range(1)
    d = C.make_instance("d-eng", "kv_consumer", 1, port=port)
    transport = PeerDiesMidWrite()
    p = C.make_instance("p-eng", "kv_producer", 1, transports=[transport])
    try:
        C.fill_prefill(p, seed=11)
        C.expect(d, "dreq", "tgone", [b for _, b in PAIRS])
        transport.d = d
        C.push(p, "preq", "tgone", C.destination(d, port), [PAIRS])
        sender = p.workers[0].sender
        assert sender is not None
        assert sender.wait_quiet("preq", 10.0)
        assert transport.writes == 1  # no retry
        assert "failed (-1)" in sender.transfers["preq"][0].error
        assert sender.transfers["preq"][0].settle_s == LATE_S  # what D is told to hold
        released, _, _ = p.workers[0].transfer_results({"preq"})
        assert released == {"preq"}  # at once, not LATE_S later
        stats = sender.stats.take()
        assert stats is not None and stats.get("write_retries_skipped") == 1, stats
        skipped = [r.getMessage() for r in caplog.records if "; no retry: " in r.getMessage()]
        assert len(skipped) == 1 and f"127.0.0.1:{port} refuses connections" in skipped[0]
    finally:
        C.close(p, d)
