"""Transports whose writes finish before the bytes land (Mooncake's tcp protocol: a write is
complete once handed to the socket; D's receive thread applies it later). P's done signal travels
on another connection and can overtake the bytes, so over such a transport P always signs its
pieces and D reports the load complete only once what landed matches — or fails it after
``landing_wait_s``. Without this, D decoded from KV still in flight (a rare divergence under load
in the end-to-end suite)."""

from __future__ import annotations

import ctypes
import itertools
import threading

import pytest
import torch

from connector.transport import InProcessTransport
from tests.connector import cluster as C

_tid = itertools.count()
PAIRS = [(0, 9), (1, 10), (2, 11), (5, 3)]


class LandsLate(InProcessTransport):
    """Applies the last piece of every write ``delay_s`` after reporting it complete (never,
    with ``delay_s=None``)."""

    def __init__(self, delay_s: float | None) -> None:
        super().__init__()
        self.delay_s = delay_s
        self.timers: list[threading.Timer] = []

    @property
    def lands_on_completion(self) -> bool:
        return False

    def write(self, session: str, src: list[int], dst: list[int], lengths: list[int]) -> None:
        super().write(session, src[:-1], dst[:-1], lengths[:-1])
        if self.delay_s is not None and src:
            s, d, n = src[-1], dst[-1], lengths[-1]
            timer = threading.Timer(self.delay_s, ctypes.memmove, (d, s, n))
            self.timers.append(timer)
            timer.start()


def _run(transport: LandsLate) -> tuple[C.Instance, C.Instance, set[str], set[str]]:
    port = C.free_port_range(1)
    d = C.make_instance("d-eng", "kv_consumer", 1, port=port)
    p = C.make_instance("p-eng", "kv_producer", 1, transports=[transport])
    C.fill_prefill(p, seed=11)
    tid = f"l{next(_tid)}"
    C.expect(d, "dreq", tid, [b for _, b in PAIRS])
    C.push(p, "preq", tid, C.destination(d, port), [PAIRS[:2], PAIRS[2:]])
    got = C.poll(d, set(), lambda acc: "dreq" in acc[0][1])
    return p, d, got[0][1], got[0][2]


def _landed(p: C.Instance, d: C.Instance) -> bool:
    return all(
        torch.equal(d.caches[0][name][db], p.caches[0][name][pb])
        for name in C.LAYERS
        for pb, db in PAIRS
    )


def test_landing_d_waits_for_bytes_its_done_signal_overtook() -> None:
    transport = LandsLate(delay_s=0.5)
    p, d, finished, failed = _run(transport)
    try:
        assert "dreq" in finished and failed == set()
        assert _landed(p, d)  # complete only once every byte is in D's blocks
        tracker = d.workers[0].tracker
        assert tracker.late_landings == 1 and tracker.corrupt == 0 and tracker.verified == 1
    finally:
        for t in transport.timers:
            t.join()
        C.close(p, d)


def test_landing_bytes_that_never_land_fail_the_load_after_the_wait(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("PDGATE_CONNECTOR_LANDING_WAIT_S", "0.3")
    p, d, finished, failed = _run(LandsLate(delay_s=None))
    try:
        assert failed == {"dreq"} and "dreq" in finished
        assert d.workers[0].tracker.corrupt == 1
        assert not _landed(p, d)
    finally:
        C.close(p, d)


def test_landing_transport_that_lands_on_completion_sends_no_digests() -> None:
    """rdma / ascend / in-process: no CRC work on either side unless verify_kv asks for it."""
    port = C.free_port_range(1)
    d = C.make_instance("d-eng", "kv_consumer", 1, port=port)
    p = C.make_instance("p-eng", "kv_producer", 1)
    try:
        C.fill_prefill(p, seed=12)
        C.expect(d, "dreq", "plain", [b for _, b in PAIRS])
        C.push(p, "preq", "plain", C.destination(d, port), [PAIRS])
        C.poll(d, set(), lambda acc: "dreq" in acc[0][1])
        assert d.workers[0].tracker.verified == 0 and _landed(p, d)
    finally:
        C.close(p, d)
