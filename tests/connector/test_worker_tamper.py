"""The test-only ``test_corrupt_push`` hook (negative control of the e2e equality tests): D gets
garbage for the first block P pushes of layer 0, P's own KV stays intact, ``verify_kv`` on D
catches it, and the hook cannot be turned on without ``PDGATE_ALLOW_TEST_HOOKS=1``."""

from __future__ import annotations

import ctypes
import itertools
import logging
import zlib

import pytest
import torch

from connector.config import ConnectorSettings, load_settings
from connector.device import CpuDevice, host_checksums
from connector.errors import ConfigError, TransferError
from connector.metadata import Destination
from connector.tp import Route
from connector.transport import InProcessTransport
from connector.worker.batch import Part, Pieces, Write
from connector.worker.tamper import PATTERN, TamperingTransport
from connector.worker.transfer import LayerTask, Transfer
from connector.worker.writer import IN_FLIGHT
from tests.connector import cluster as C
from tests.support.sealing import key_file, sealed

_tid = itertools.count()
PAIRS = [(0, 9), (1, 10), (2, 11), (5, 3)]  # P block -> D block; 0,1 -> 9,10 coalesce
GARBAGE = torch.frombuffer(bytearray([PATTERN] * 4), dtype=torch.float32)[0]


class SignalsBeforeLanding(InProcessTransport):
    """Claims its writes finish before they land (as Mooncake tcp does): P then always sends
    digests, as proof of arrival, even without ``verify_kv``."""

    @property
    def lands_on_completion(self) -> bool:
        return False


class FailsFirstWrite(InProcessTransport):
    """The first write fails (a stalled lane): P's sender writes the batch again."""

    def __init__(self) -> None:
        super().__init__()
        self.failed = False

    def write(self, session: str, src: list[int], dst: list[int], lengths: list[int]) -> None:
        if not self.failed:
            self.failed = True
            raise TransferError(f"in-process write to {session} failed (injected)")
        super().write(session, src, dst, lengths)


def _hooks_on(monkeypatch: pytest.MonkeyPatch, verify: bool) -> None:
    monkeypatch.setenv("PDGATE_ALLOW_TEST_HOOKS", "1")
    monkeypatch.setenv("PDGATE_CONNECTOR_TEST_CORRUPT_PUSH", "1")
    monkeypatch.setenv("PDGATE_CONNECTOR_LANDING_WAIT_S", "0.3")  # a mismatch stays a mismatch
    if verify:
        monkeypatch.setenv("PDGATE_CONNECTOR_VERIFY_KV", "1")


def _run(
    transport: InProcessTransport | None = None,
) -> tuple[C.Instance, C.Instance, dict[str, torch.Tensor], set[str]]:
    port = C.free_port_range(1)
    d = C.make_instance("d-eng", "kv_consumer", 1, port=port)
    p = C.make_instance(
        "p-eng", "kv_producer", 1, transports=[transport] if transport is not None else None
    )
    full = C.fill_prefill(p, seed=11)
    tid = f"t{next(_tid)}"
    C.expect(d, "dreq", tid, [b for _, b in PAIRS])
    C.push(p, "preq", tid, C.destination(d, port), [PAIRS[:2], PAIRS[2:]])
    got = C.poll(d, set(), lambda acc: "dreq" in acc[0][1])
    return p, d, full, got[0][2]


def _assert_only_first_block_of_layer_0_is_garbage(
    p: C.Instance, d: C.Instance, full: dict[str, torch.Tensor]
) -> None:
    first_p, first_d = PAIRS[0]
    layer0 = C.LAYERS[0]
    assert torch.all(d.caches[0][layer0][first_d] == GARBAGE)
    for name in C.LAYERS:
        assert torch.equal(p.caches[0][name], full[name])  # P's own KV is never touched
        for pb, db in PAIRS:
            if (name, pb) != (layer0, first_p):
                assert torch.equal(d.caches[0][name][db], full[name][pb]), (name, pb)


def test_tamper_hook_is_refused_without_the_allow_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PDGATE_ALLOW_TEST_HOOKS", raising=False)
    with pytest.raises(ConfigError, match="PDGATE_ALLOW_TEST_HOOKS=1"):
        load_settings(sealed({"test_corrupt_push": True}))
    monkeypatch.setenv("PDGATE_ALLOW_TEST_HOOKS", "yes")  # only "1" counts
    with pytest.raises(ConfigError, match="test-only"):
        load_settings(sealed({"test_corrupt_push": True}))
    assert load_settings(sealed({})).test_corrupt_push is False
    monkeypatch.setenv("PDGATE_ALLOW_TEST_HOOKS", "1")
    assert load_settings(sealed({"test_corrupt_push": True})).test_corrupt_push is True
    assert (
        ConnectorSettings(side_channel_secret_file=key_file()).test_corrupt_push is False
    )  # off by default, even when allowed


def test_tamper_apply_replaces_at_most_one_block_of_the_first_piece() -> None:
    t = InProcessTransport()
    tamper = TamperingTransport(t, 64, "test")
    # a coalesced piece of two blocks: its first 64 bytes come from the buffer, the rest intact
    src, dst, lengths = tamper.apply([1000, 5000], [2000, 6000], [128, 64])
    assert (src, dst, lengths) == ([tamper.addr, 1064, 5000], [2000, 2064, 6000], [64, 64, 64])
    # a piece smaller than a block (a TP head slice) is replaced entirely
    assert tamper.apply([1000], [2000], [16]) == ([tamper.addr], [2000], [16])
    assert tamper.apply([], [], []) == ([], [], [])
    assert tamper.corrupted == 2
    assert t._regions == [(tamper.addr, 64)]  # registered: the transport may read from it
    t.close()


def test_tamper_d_gets_garbage_for_the_first_block_of_layer_0_only(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="pdgate")
    _hooks_on(monkeypatch, verify=False)
    p, d, full, failed = _run()
    try:
        assert failed == set()  # without verify_kv the wrong KV goes unnoticed
        _assert_only_first_block_of_layer_0_is_garbage(p, d, full)
        tamper = p.workers[0].tamper
        assert tamper is not None  # the worker gave its sender the tampering transport
        assert tamper.corrupted == 1  # once per transfer, not once per chunk
        assert any("TEST HOOK test_corrupt_push IS ON" in r.getMessage() for r in caplog.records)
    finally:
        C.close(p, d)


def test_tamper_with_verify_kv_d_fails_the_load_naming_the_block(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.ERROR, logger="pdgate")
    _hooks_on(monkeypatch, verify=True)
    p, d, _, failed = _run()
    try:
        assert failed == {"dreq"}  # vLLM recomputes (policy recompute) instead of decoding
        assert d.workers[0].tracker.corrupt == 1 and d.workers[0].tracker.verified == 0
        messages = [r.getMessage() for r in caplog.records]
        assert any(
            "does not match" in m
            and f"layer {C.LAYERS[0]} plane 0 blocks 9..10" in m  # blocks 9-10: one signed piece
            for m in messages
        ), messages
        # the checksums describe P's intended KV: P sees nothing changed on its side
        assert not any("changed after the push" in m for m in messages)
    finally:
        C.close(p, d)


def test_tamper_off_sends_p_kv_unchanged(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PDGATE_ALLOW_TEST_HOOKS", "1")  # allowed but not on: nothing happens
    p, d, full, failed = _run()
    try:
        assert failed == set()
        assert p.workers[0].tamper is None
        for name in C.LAYERS:
            for pb, db in PAIRS:
                assert torch.equal(d.caches[0][name][db], full[name][pb])
    finally:
        C.close(p, d)


def test_tamper_arrival_digests_describe_what_was_sent_so_d_takes_the_garbage(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Over a transport whose writes finish before they land (Mooncake tcp) P signs every piece
    even without verify_kv, only as proof of arrival: those digests are of the bytes sent, so the
    corrupted block still reaches vLLM as complete — what the e2e negative control relies on."""
    _hooks_on(monkeypatch, verify=False)
    p, d, full, failed = _run(SignalsBeforeLanding())
    try:
        sender = p.workers[0].sender
        assert sender is not None  # arrival digests:
        assert sender.options.verify and not sender.options.recheck_sources
        assert failed == set()
        assert d.workers[0].tracker.verified == 1 and d.workers[0].tracker.corrupt == 0
        _assert_only_first_block_of_layer_0_is_garbage(p, d, full)
    finally:
        C.close(p, d)


def test_tamper_with_verify_kv_over_a_late_landing_transport_still_fails_the_load(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    _hooks_on(monkeypatch, verify=True)
    p, d, _, failed = _run(SignalsBeforeLanding())
    try:
        sender = p.workers[0].sender
        assert sender is not None
        assert sender.options.verify and sender.options.recheck_sources
        assert failed == {"dreq"} and d.workers[0].tracker.corrupt == 1
    finally:
        C.close(p, d)


def test_tamper_a_retried_write_sends_the_same_garbage(monkeypatch: pytest.MonkeyPatch) -> None:
    _hooks_on(monkeypatch, verify=False)
    transport = FailsFirstWrite()
    p, d, full, failed = _run(transport)
    try:
        assert transport.failed and failed == set()
        _assert_only_first_block_of_layer_0_is_garbage(p, d, full)
        tamper = p.workers[0].tamper
        assert tamper is not None and tamper.corrupted == 1
    finally:
        C.close(p, d)


def _write_of(layer: int, pieces: Pieces, session: str) -> Write:
    dest = Destination("d", "d-eng", "127.0.0.1", 1, 1, 1, False, 16)
    legs: list[Transfer] = []
    tr = Transfer("req", "tid", dest, Route(0, 0, 1, 0, 1), legs)
    legs.append(tr)
    w = Write(session)
    w.add(Part(LayerTask(tr, [(0, 0)], layer, CpuDevice().record_event()), 0, pieces))
    return w


def test_tamper_sent_checksums_are_of_the_bytes_that_landed() -> None:
    """Arrival digests over the tampering transport: the CRC32 of a piece whose head came from
    the pattern buffer is that of the bytes D received (pattern, then the rest of P's source)."""
    p_mem, d_mem = (ctypes.c_ubyte * 256)(*range(256)), (ctypes.c_ubyte * 256)()
    p_t, d_t = InProcessTransport(), InProcessTransport()
    p_t.register(ctypes.addressof(p_mem), 256)
    d_t.register(ctypes.addressof(d_mem), 256)
    tamper = TamperingTransport(p_t, 64, "test")
    src, dst = ctypes.addressof(p_mem), ctypes.addressof(d_mem)
    pieces = Pieces([src, src + 200], [dst, dst + 200], [160, 16])  # 160 > one "block" of 64
    w = _write_of(0, pieces, d_t.session)
    token = IN_FLIGHT.set(w)
    try:
        tamper.write(w.session, w.src, w.dst, w.lengths)
    finally:
        IN_FLIGHT.reset(token)
    assert bytes(d_mem[:64]) == bytes([PATTERN]) * 64 and bytes(d_mem[64:160]) == bytes(
        p_mem[64:160]
    )
    sent = tamper.sent_checksums(host_checksums)
    got = sent(list(zip(pieces.src, pieces.lengths, strict=True)))
    assert got == [zlib.crc32(bytes(d_mem[:160])), zlib.crc32(bytes(d_mem[200:216]))]
    assert sent([(src, 160)]) == host_checksums([(src, 160)])  # taken once: then P's own bytes
    assert tamper.corrupted == 1
    other = _write_of(1, pieces, d_t.session)  # not layer 0: sent as it is
    tamper.write(other.session, other.src, other.dst, other.lengths)
    assert tamper.corrupted == 1
    for t in (p_t, d_t):
        t.close()
