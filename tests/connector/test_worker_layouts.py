"""Every vLLM KV layout into every other, and vllm-ascend's K/V tensors, through the worker
halves (in-process transport): D's logical ``[B, H, N, C]`` blocks end up exactly P's.

The caches are made by vLLM's own planner and allocator (``tests/connector/vllm_kv.py``) or by
vllm-ascend's allocation rules (``tests/support/kv_views.py``); P and D each pick a layout."""

from __future__ import annotations

import itertools
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from connector.errors import LayoutError
from tests.connector import cluster as C
from tests.connector import harness as H
from tests.connector.vllm_kv import LAYOUTS, planned
from tests.support import kv_views

LAYERS = [f"model.layers.{i}.self_attn.attn" for i in range(3)]
HEADS, HEAD, BLOCKS, BS = 4, 8, 24, 16
# three chunks: a run, a reversed pair, a lone (tail) block; D's blocks scattered
CHUNKS = [[(0, 9), (1, 10), (2, 11)], [(3, 5), (4, 4)], [(5, 20)]]
PAIRS = list(itertools.product(LAYOUTS, LAYOUTS))
# vLLM's preference when no backend narrows it (vllm/v1/attention/backends/utils.py)
LAYOUTS_PREFERRED = ["LBNHC", "LBHNC", "BLNHC", "BLHNC", "BHLNC", "LHBNC"]
_tid = itertools.count()

Alloc = Callable[[int], dict[str, Any]]


def vllm_alloc(layout: str, *, mla: bool = False, kernel: int | None = None) -> Alloc:
    def alloc(local_heads: int) -> dict[str, Any]:
        return planned(
            layout,
            LAYERS,
            blocks=BLOCKS,
            heads=local_heads,
            block_size=BS,
            head_size=4 * HEAD if mla else HEAD,
            mla=mla,
            kernel_block_size=kernel,
        )

    return alloc


def ascend_alloc(kind: str = "gqa", *, kernel: int | None = None) -> Alloc:
    def alloc(local_heads: int) -> dict[str, Any]:
        return dict(
            kv_views.ascend_views(
                LAYERS,
                blocks=BLOCKS,
                heads=local_heads,
                head_size=32 if kind != "gqa" else HEAD,
                block_size=BS,
                kind=kind,
                kernel_block_size=kernel,
            )
        )

    return alloc


def _parts(value: Any) -> list[torch.Tensor]:
    split = isinstance(value, tuple)
    return [kv_views.logical(t, split) for t in (value if split else (value,))]


def _fill(p: C.Instance, seed: int) -> None:
    """Random KV on every P rank; ranks holding the same heads (MLA's latent, GQA with more
    ranks than KV heads) hold the same KV, as replicas do in vLLM."""
    g = torch.Generator().manual_seed(seed)
    for rank, caches in enumerate(p.caches):
        twin = next(r for r in range(rank + 1) if r == rank or _held(p, r) == _held(p, rank))
        for name, value in caches.items():
            for i, part in enumerate(_parts(value)):
                if twin != rank:
                    part.copy_(_parts(p.caches[twin][name])[i])
                else:
                    part.copy_(torch.randn(part.shape, generator=g).to(part.dtype))


def _held(inst: C.Instance, rank: int) -> tuple[int, int]:
    return (0, 1) if inst.mla else inst.local(rank)


def _run(
    p_alloc: Alloc,
    d_alloc: Alloc,
    p_tp: int,
    *,
    d_tp: int = 1,
    heads: int = HEADS,
    mla: bool = False,
) -> None:
    port = C.free_port_range(d_tp)
    d = C.make_instance(
        "d-eng",
        "kv_consumer",
        d_tp,
        heads=heads,
        mla=mla,
        port=port,
        block_size=BS,
        layers=LAYERS,
        allocate=d_alloc,
    )
    p = C.make_instance(
        "p-eng",
        "kv_producer",
        p_tp,
        heads=heads,
        mla=mla,
        block_size=BS,
        layers=LAYERS,
        allocate=p_alloc,
    )
    try:
        _fill(p, seed=next(_tid))
        tid = f"t{next(_tid)}"
        pairs = [pair for chunk in CHUNKS for pair in chunk]
        C.expect(d, "dreq", tid, [b for _, b in pairs])
        C.push(p, "preq", tid, C.destination(d, port), CHUNKS)
        got = C.poll(d, set(), lambda acc: all("dreq" in r for _, r, _ in acc))
        assert all(not f for _, _, f in got), got
        written = {db for _, db in pairs}
        for name in LAYERS:
            for d_rank in range(d_tp):
                d_parts = _parts(d.caches[d_rank][name])
                d_start, d_count = _held(d, d_rank)
                for k in range(d_count):  # each of D's heads: from a P rank that holds it
                    g = d_start + k
                    p_rank = next(r for r in range(p_tp) if _held(p, r)[0] <= g < sum(_held(p, r)))
                    p_parts = _parts(p.caches[p_rank][name])
                    for i, src in enumerate(p_parts):
                        for pb, db in pairs:
                            want = kv_views.block(src, pb, BS)[g - _held(p, p_rank)[0]]
                            have = kv_views.block(d_parts[i], db, BS)[k]
                            assert torch.equal(have, want), (name, d_rank, k, i, pb, db)
                for part in d_parts:
                    for b in set(range(BLOCKS)) - written:
                        assert not kv_views.block(part, b, BS).any(), (name, d_rank, b)
    finally:
        C.close(p, d)


TP_SIZES = [(p, d) for p in (1, 2, 4) for d in (1, 2, 4)]


@pytest.mark.parametrize("heads", [1, 2, 4, 8, "mla"])
@pytest.mark.parametrize(("p_tp", "d_tp"), TP_SIZES, ids=[f"p{p}-d{d}" for p, d in TP_SIZES])
def test_worker_layouts_every_tp_pairing(p_tp: int, d_tp: int, heads: int | str) -> None:
    """vLLM's own allocation on both sides, P tp and D tp in any order, GQA with 1-8 KV heads
    (split or replicated over the ranks) and MLA; P head-major pages, D token-major ones."""
    mla = heads == "mla"
    n = 1 if mla else int(heads)
    _run(
        vllm_alloc("LBHNC", mla=mla),
        vllm_alloc("LBNHC", mla=mla),
        p_tp,
        d_tp=d_tp,
        heads=n,
        mla=mla,
    )


@pytest.mark.parametrize(
    ("p_tp", "d_tp"), [(1, 1), (2, 1), (1, 2)], ids=["tp1to1", "tp2to1", "tp1to2"]
)
@pytest.mark.parametrize(("p_layout", "d_layout"), PAIRS, ids=[f"P{x}-D{y}" for x, y in PAIRS])
def test_worker_layouts_gqa_every_pair(p_layout: str, d_layout: str, p_tp: int, d_tp: int) -> None:
    _run(vllm_alloc(p_layout), vllm_alloc(d_layout), p_tp, d_tp=d_tp)


@pytest.mark.parametrize("p_tp", [1, 2], ids=["tp1to1", "tp2to1"])
@pytest.mark.parametrize(("p_layout", "d_layout"), PAIRS, ids=[f"P{x}-D{y}" for x, y in PAIRS])
def test_worker_layouts_mla_every_pair(p_layout: str, d_layout: str, p_tp: int) -> None:
    _run(vllm_alloc(p_layout, mla=True), vllm_alloc(d_layout, mla=True), p_tp, mla=True)


@pytest.mark.parametrize(
    ("p_layout", "d_layout"), [("LBHNC", "BLNHC"), ("LBNHC", "LHBNC"), ("LBNHC", "LBNHC")]
)
def test_worker_layouts_kernel_blocks_on_p_only(p_layout: str, d_layout: str) -> None:
    """vLLM splits P's blocks of 16 into kernel blocks of 4 (a hybrid model's attention); D's
    are whole: tokens still land in order."""
    _run(vllm_alloc(p_layout, kernel=4), vllm_alloc(d_layout), 2)


@pytest.mark.parametrize("kind", ["gqa", "mla", "dsa"])
@pytest.mark.parametrize(
    ("p_tp", "d_tp"), [(1, 1), (2, 1), (1, 2)], ids=["tp1to1", "tp2to1", "tp1to2"]
)
def test_worker_layouts_ascend_separate_tensors(kind: str, p_tp: int, d_tp: int) -> None:
    _run(ascend_alloc(kind), ascend_alloc(kind), p_tp, d_tp=d_tp, mla=kind != "gqa")


def test_worker_layouts_ascend_kernel_blocks_to_whole_blocks() -> None:
    """vllm-ascend with several KV-cache groups: kernel blocks of 8 inside blocks of 16."""
    _run(ascend_alloc(kernel=8), ascend_alloc(), 2)


def test_worker_layouts_one_tensor_to_separate_k_v_is_refused_at_handshake(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """P with vLLM's single K|V tensor, D with vllm-ascend's separate K and V: the content
    order cannot be matched from the tensors, so the handshake refuses; D's load fails (it
    recomputes) and nothing is written."""
    port = C.free_port_range(1)
    d = C.make_instance(
        "d-eng",
        "kv_consumer",
        1,
        heads=HEADS,
        port=port,
        block_size=BS,
        layers=LAYERS,
        allocate=ascend_alloc(),
    )
    p = C.make_instance(
        "p-eng",
        "kv_producer",
        1,
        heads=HEADS,
        block_size=BS,
        layers=LAYERS,
        allocate=vllm_alloc("LBNHC"),
    )
    try:
        _fill(p, seed=1)
        C.expect(d, "dreq", "tref", [3, 4])
        with caplog.at_level(logging.WARNING, logger="pdgate.connector"):
            C.push(p, "preq", "tref", C.destination(d, port), [[(0, 3), (1, 4)]])
            got = C.poll(d, set(), lambda acc: all("dreq" in f for _, _, f in acc))
        assert got[0][2] == {"dreq"}
        refused = [r.getMessage() for r in caplog.records if "handshake with" in r.getMessage()]
        assert refused and "planes (content start, bytes)" in refused[0], refused
        assert "layer model.layers.0.self_attn.attn" in refused[0]
        assert all(not t.any() for value in d.caches[0].values() for t in value)
    finally:
        C.close(p, d)


def test_worker_layouts_different_head_size_is_refused_at_handshake(
    caplog: pytest.LogCaptureFixture,
) -> None:
    port = C.free_port_range(1)
    d = C.make_instance(
        "d-eng",
        "kv_consumer",
        1,
        heads=HEADS,
        port=port,
        block_size=BS,
        layers=LAYERS,
        allocate=vllm_alloc("LBHNC"),
    )

    def wider(local_heads: int) -> dict[str, Any]:
        return planned("LBHNC", LAYERS, blocks=BLOCKS, heads=local_heads, head_size=2 * HEAD)

    p = C.make_instance(
        "p-eng", "kv_producer", 1, heads=HEADS, block_size=BS, layers=LAYERS, allocate=wider
    )
    try:
        C.expect(d, "dreq", "thead", [3])
        with caplog.at_level(logging.WARNING, logger="pdgate.connector"):
            C.push(p, "preq", "thead", C.destination(d, port), [[(0, 3)]])
            C.poll(d, set(), lambda acc: all("dreq" in f for _, _, f in acc))
            sent = C.poll(p, {"preq"}, lambda acc: all("preq" in s for s, _, _ in acc))
        assert sent[0][0] == {"preq"}  # P releases its blocks
        text = "\n".join(r.getMessage() for r in caplog.records)
        assert "bytes per token-head P 64 vs D 32" in text, text
        assert p.workers[0].sender is not None and p.workers[0].sender.writes == 0
    finally:
        C.close(p, d)


def test_worker_layouts_non_dense_pages_are_refused_at_registration() -> None:
    caches = planned("LBHNC", LAYERS, blocks=BLOCKS, heads=HEADS, head_size=HEAD)
    t = caches[LAYERS[1]]
    caches[LAYERS[1]] = torch.as_strided(t, t.shape, (t.stride(0), 4, 16, 1))  # heads overlap
    with pytest.raises(LayoutError) as exc:
        C.make_instance(
            "p-eng",
            "kv_producer",
            1,
            heads=HEADS,
            block_size=BS,
            layers=LAYERS,
            allocate=lambda _: caches,
        )
    assert str(exc.value).startswith(
        f"layer {LAYERS[1]}: shape (24, 4, 16, 16) strides ({t.stride(0)}, 4, 16, 1): pages overlap"
    )


@pytest.mark.parametrize(
    ("extra", "want"),
    [
        ({}, "LBHNC"),
        ({"kv_cache_layout": "BLHNC"}, "BLHNC"),
        ({"kv_cache_layout": "backend"}, "LBNHC"),
    ],
)
def test_connector_asks_vllm_for_head_major_pages(
    tiny_model: Path, extra: dict[str, Any], want: str
) -> None:
    """vLLM's own resolution (engine core, every layout supported) takes the connector's
    request; ``backend`` leaves vLLM's first preference."""
    from vllm.v1.attention.backends.utils import resolve_kv_cache_layout

    config = H.vllm_config(tiny_model, "kv_consumer", extra)
    assert resolve_kv_cache_layout(config, [LAYOUTS_PREFERRED]).name == want


def test_connector_refuses_vllm_ascend_nz_kv_at_start(tiny_model: Path) -> None:
    """enable_kv_nz (vllm-ascend, D only) reorders the bytes inside D's blocks; the tensors
    look the same, so the engine option itself is refused."""
    from connector.compat import refuse_unsupported
    from connector.errors import ConfigError

    config = H.vllm_config(tiny_model, "kv_consumer", {})
    refuse_unsupported(config)
    config.additional_config = {"enable_kv_nz": True}
    with pytest.raises(ConfigError, match="enable_kv_nz keeps D's blocks in NZ order"):
        refuse_unsupported(config)


@pytest.mark.parametrize(("size", "index"), [(2, 0), (1, 1)])
def test_connector_refuses_data_parallel_engines_at_start(
    tiny_model: Path, size: int, index: int
) -> None:
    """A DP engine (dense models: size reset to 1, but index > 0) is refused with a clear
    error, for both roles, before the connector registers anything."""
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
    from vllm.v1.kv_cache_interface import KVCacheConfig

    from connector.connector import PdgateConnector
    from connector.errors import ConfigError

    for role in ("kv_consumer", "kv_producer"):
        config = H.vllm_config(tiny_model, role, {})
        config.parallel_config.data_parallel_size = size
        config.parallel_config.data_parallel_index = index
        with pytest.raises(ConfigError, match="data parallelism .* not supported"):
            PdgateConnector(config, KVConnectorRole.SCHEDULER, KVCacheConfig(1, [], []))
