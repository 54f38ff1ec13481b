"""A write that fails once (a stalled Mooncake tcp lane hitting its deadline) is retried by P's
sender; the transfer then completes with exactly P's KV in D's blocks instead of making D
recompute the whole prompt. With retries off, the same fault fails the transfer on both sides.

Either way the failed attempt's pieces may still land later (Mooncake abandons a timed-out
write, it does not cancel it), so D holds the blocks for the transport's ``late_landing_s``
before decoding from them or freeing them, and P keeps its source blocks as long."""

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
    monkeypatch: pytest.MonkeyPatch, retries: int
) -> tuple[C.Instance, C.Instance, set[str], float]:
    """Push; returns P, D, D's failed loads and how long after P's signal D reported."""
    monkeypatch.setenv("PDGATE_CONNECTOR_WRITE_RETRIES", str(retries))
    port = C.free_port_range(1)
    d = C.make_instance("d-eng", "kv_consumer", 1, port=port)
    p = C.make_instance("p-eng", "kv_producer", 1, transports=[FailsOnce()])
    C.fill_prefill(p, seed=11)
    C.expect(d, "dreq", "tretry", [b for _, b in PAIRS])
    C.push(p, "preq", "tretry", C.destination(d, port), [PAIRS[:2], PAIRS[2:]])
    sender = p.workers[0].sender
    assert sender is not None
    assert sender.wait_quiet("preq", 10.0)
    signalled = time.monotonic()
    # P keeps its source blocks while the abandoned attempt could still read them
    early, _, _ = p.workers[0].transfer_results({"preq"})
    assert early == set()
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
        assert sender is not None and not sender.transfers["preq"].error
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
        sent = C.poll(p, set(), lambda acc: "preq" in acc[0][0])
        assert sent[0][0] == {"preq"}  # P's blocks released
        messages = [r.getMessage() for r in caplog.records]
        assert not any("; retry " in m for m in messages)
        assert any("transfer tretry" in m and "failed (-1)" in m for m in messages)
        assert any("holding its blocks" in m and "failing the load" in m for m in messages)
    finally:
        C.close(p, d)
