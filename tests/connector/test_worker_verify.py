"""``verify_kv``: P sends a crc32 per pushed piece with its done signal and D checks its blocks
before reporting the load complete, so KV that did not land (or changed on P after the push)
fails the load, naming the layer and blocks, instead of being decoded from silently."""

from __future__ import annotations

import itertools
import logging

import pytest
import torch

from connector.device import host_checksums
from connector.transport import InProcessTransport
from connector.worker import digest
from tests.connector import cluster as C
from tests.support.sealing import key_file

_tid = itertools.count()
PAIRS = [(0, 9), (1, 10), (2, 11), (5, 3)]


class LosesLastPiece(InProcessTransport):
    """Reports success for a batch whose last piece never reached D (fault injection: what a
    transport that completes before the bytes are applied at the destination looks like)."""

    def __init__(self) -> None:
        super().__init__()
        self.lose_after = 0  # number of write calls to let through intact

    def write(self, session: str, src: list[int], dst: list[int], lengths: list[int]) -> None:
        if self.calls >= self.lose_after and len(src) > 0:
            super().write(session, src[:-1], dst[:-1], lengths[:-1])
            return
        super().write(session, src, dst, lengths)


def _run(
    monkeypatch: pytest.MonkeyPatch, verify: bool, transport: InProcessTransport | None = None
) -> tuple[C.Instance, C.Instance, set[str], int]:
    monkeypatch.setenv("PDGATE_CONNECTOR_LANDING_WAIT_S", "0.3")  # a lost piece never lands
    if verify:
        monkeypatch.setenv("PDGATE_CONNECTOR_VERIFY_KV", "1")
    port = C.free_port_range(1)
    d = C.make_instance("d-eng", "kv_consumer", 1, port=port)
    p = C.make_instance(
        "p-eng", "kv_producer", 1, transports=[transport] if transport is not None else None
    )
    C.fill_prefill(p, seed=7)
    tid = f"v{next(_tid)}"
    C.expect(d, "dreq", tid, [b for _, b in PAIRS])
    C.push(p, "preq", tid, C.destination(d, port), [PAIRS[:2], PAIRS[2:]])
    got = C.poll(d, set(), lambda acc: "dreq" in acc[0][1])
    return p, d, got[0][2], d.workers[0].tracker.corrupt


def test_verify_kv_intact_push_completes_and_p_signs_every_piece(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    p, d, failed, corrupt = _run(monkeypatch, verify=True)
    try:
        assert failed == set() and corrupt == 0
        assert d.workers[0].tracker.verified == 1
        sender = p.workers[0].sender
        assert sender is not None
        written = sender.transfers["preq"][0].written
        assert {w[0] for w in written} == set(range(len(C.LAYERS)))  # every layer signed
        pushed = sum(n for *_, n, _ in written)
        assert pushed == len(PAIRS) * len(C.LAYERS) * d.caches[0][C.LAYERS[0]][0].nbytes
    finally:
        C.close(p, d)


def test_verify_kv_fails_a_load_whose_last_piece_never_landed(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.ERROR, logger="pdgate")
    p, d, failed, corrupt = _run(monkeypatch, verify=True, transport=LosesLastPiece())
    try:
        assert failed == {"dreq"} and corrupt == 1
        errors = [r.getMessage() for r in caplog.records if "does not match" in r.getMessage()]
        assert len(errors) == 1 and "blocks" in errors[0] and "layer model.layers." in errors[0]
    finally:
        C.close(p, d)


def test_without_verify_kv_the_lost_piece_goes_unnoticed(monkeypatch: pytest.MonkeyPatch) -> None:
    """The failure mode the check exists for: the load is reported complete over wrong KV."""
    p, d, failed, corrupt = _run(monkeypatch, verify=False, transport=LosesLastPiece())
    try:
        assert failed == set() and corrupt == 0
        d_blocks = d.caches[0]
        p_blocks = p.caches[0]
        assert any(
            not torch.equal(d_blocks[name][db], p_blocks[name][pb])
            for name in C.LAYERS
            for pb, db in PAIRS
        )
    finally:
        C.close(p, d)


def test_verify_kv_p_reports_kv_that_changed_after_it_was_pushed(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A block pushed before its KV was final: P logs it, D fails the load."""
    caplog.set_level(logging.ERROR, logger="pdgate")
    monkeypatch.setenv("PDGATE_CONNECTOR_VERIFY_KV", "1")
    monkeypatch.setenv("PDGATE_CONNECTOR_LANDING_WAIT_S", "0.3")
    port = C.free_port_range(1)
    d = C.make_instance("d-eng", "kv_consumer", 1, port=port)
    p = C.make_instance("p-eng", "kv_producer", 1)
    try:
        C.fill_prefill(p, seed=3)
        tid = f"v{next(_tid)}"
        dest = C.destination(d, port)
        C.expect(d, "dreq", tid, [b for _, b in PAIRS])
        C.push(p, "preq", tid, dest, [PAIRS[:2]], final=False)
        sender = p.workers[0].sender
        assert sender is not None
        assert sender.wait_quiet("preq", 10.0)
        p.caches[0][C.LAYERS[2]][1].add_(1.0)  # P's block 1 of layer 2 changes after its push
        C.push(p, "preq", tid, dest, [PAIRS[2:]])
        got = C.poll(d, set(), lambda acc: "dreq" in acc[0][1])
        assert got[0][2] == {"dreq"}
        messages = [r.getMessage() for r in caplog.records]
        assert any("changed after the push" in m and "D layer #2" in m for m in messages)
        assert any(
            "does not match" in m
            and "layer model.layers.2." in m
            and "blocks 9..10" in m  # P blocks 0-1 went as one piece
            for m in messages
        )
    finally:
        C.close(p, d)


def test_digest_check_names_the_first_mismatching_layer_and_blocks() -> None:
    d = C.make_instance("d-eng", "kv_consumer", 1, port=C.free_port_range(1))
    try:
        memory = d.workers[0].memory
        assert memory is not None
        t = d.caches[0][C.LAYERS[1]]
        start, n = t[4].data_ptr(), 2 * t[4].nbytes  # blocks 4..5 of layer 1
        good = host_checksums([(start, n)])[0]
        assert digest.check(memory, [(1, start, n, good)]) == ""
        problem = digest.check(memory, [(1, start, n, good ^ 1)])
        assert "layer model.layers.1.self_attn.attn" in problem and "blocks 4..5" in problem
        assert "outside" in digest.check(memory, [(1, 16, 8, 0)])  # never reads foreign memory
    finally:
        C.close(d)


class _NpuDouble:
    """Stands in for ``device: npu`` (torch_npu is not installed here): only its name and that
    its memory cannot be read for digests matter."""

    name = "npu"

    def record_event(self) -> object:
        raise AssertionError("no forward in this test")

    def checksums(self, pieces: object) -> list[int]:
        raise AssertionError("must not be called")


def test_verify_kv_on_npu_memory_is_refused_at_start() -> None:
    from connector.config import ConnectorSettings
    from connector.errors import ConfigError
    from connector.worker import ConnectorWorker

    w = ConnectorWorker(
        None,
        ConnectorSettings(
            transport="inprocess", verify_kv=True, side_channel_secret_file=key_file()
        ),
        rank=0,
        tp_size=1,
        engine_id="p-eng",
        role="kv_producer",
        transport=InProcessTransport(),
        device=_NpuDouble(),  # type: ignore[arg-type]
    )
    try:
        with pytest.raises(ConfigError, match="verify_kv reads the pushed KV back .* npu memory"):
            w.register_kv_caches({"l0": torch.zeros(4, 2, 16, 8)})
    finally:
        w.shutdown()
