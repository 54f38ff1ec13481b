"""Placement read from strides: byte runs between any two layouts, coalescing, refusals; and
the heterogeneous-TP routing table."""

from __future__ import annotations

import msgspec
import pytest
import torch

from connector import tp
from connector.errors import LayoutError
from connector.layout import LayerLayout, Piece, check_compatible, coalesce, pair_pieces, plane_of
from connector.worker.memory import KVMemory, describe_layer


def _layout(
    shape: tuple[int, ...],
    strides: tuple[int, ...],
    order: str = "BHNC",
    itemsize: int = 2,
    block_size: int | None = None,
) -> LayerLayout:
    plane, blocks, heads = plane_of("t", shape, strides, itemsize, "float16", order, block_size, 0)
    n = block_size or shape[2 if order == "BHNC" else 1]
    return LayerLayout(blocks, heads, n, (plane,))


HEAD_MAJOR = ((10, 4, 16, 8), (512, 128, 8, 1))  # [B, H, N, C] dense: LBHNC
TOKEN_MAJOR = ((10, 4, 16, 8), (512, 8, 32, 1))  # the same view, token-major pages: LBNHC


def test_layout_head_major_head_slice_is_one_run_per_block() -> None:
    lay = _layout(*HEAD_MAJOR)
    page = 16 * 8 * 2
    assert pair_pieces(lay, lay, [(3, 3)], (1, 2), 1) == [
        Piece(0, 3 * 4 * page + page, 3 * 4 * page + page, 2 * page)
    ]


def test_layout_token_major_head_slice_is_one_run_per_token() -> None:
    lay = _layout(*TOKEN_MAJOR)
    got = pair_pieces(lay, lay, [(1, 1)], (2, 1), 2)
    block, token, head = 512 * 2, 32 * 2, 8 * 2
    assert got == [
        Piece(0, block + t * token + 2 * head, block + t * token + 2 * head, head)
        for t in range(16)
    ]
    assert pair_pieces(lay, lay, [(1, 1)], (0, 4), 0) == [Piece(0, block, block, block)]


def test_layout_head_major_to_token_major_moves_one_token_head_at_a_time() -> None:
    p, d = _layout(*HEAD_MAJOR), _layout(*TOKEN_MAJOR)
    got = pair_pieces(p, d, [(0, 2)], (0, 4), 0)
    assert len(got) == 4 * 16 and {x.length for x in got} == {16}
    assert Piece(0, 128 * 2 + 8 * 2, 2 * 1024 + 32 * 2 + 8 * 2, 16) in got  # head 1, token 1


def test_layout_coalesces_runs_on_both_sides_only() -> None:
    lay = _layout(*HEAD_MAJOR)
    bb = 512 * 2
    assert pair_pieces(lay, lay, [(0, 5), (1, 6), (2, 8), (7, 1)], (0, 4), 0) == [
        Piece(0, 0, 5 * bb, 2 * bb),
        Piece(0, 2 * bb, 8 * bb, bb),
        Piece(0, 7 * bb, bb, bb),
    ]
    assert coalesce([Piece(0, 0, 0, 4), Piece(1, 4, 4, 4)]) == [
        Piece(0, 0, 0, 4),
        Piece(1, 4, 4, 4),
    ]


def test_layout_heads_outer_to_blocks_coalesce_per_head_across_blocks() -> None:
    lay = _layout((10, 4, 16, 8), (128, 1280, 8, 1))  # LHBNC
    got = pair_pieces(lay, lay, [(2, 2), (3, 3)], (0, 4), 0)
    assert got == [Piece(0, h * 2560 + 2 * 256, h * 2560 + 2 * 256, 2 * 256) for h in range(4)]


def test_layout_kernel_blocks_pair_with_whole_blocks_token_by_token() -> None:
    split = _layout((20, 2, 8, 8), (256, 128, 8, 1), block_size=16)  # 2 kernel blocks a block
    whole = _layout((10, 2, 16, 8), (256, 8, 16, 1))  # token-major whole blocks
    assert split.num_blocks == 10 and split.planes[0].token_axes == ((2, 512), (8, 16))
    got = pair_pieces(split, whole, [(1, 3)], (0, 2), 0)
    # token 9 of head 1: kernel block 1 of block 1, token 1 -> D block 3, token 9, head 1
    assert Piece(0, 1024 + 512 + 256 + 16, 3 * 512 + 9 * 32 + 16, 16) in got
    assert sum(x.length for x in got) == split.block_bytes


def test_layout_locate_finds_block_and_head_for_any_order() -> None:
    for shape, strides in (HEAD_MAJOR, TOKEN_MAJOR, ((10, 4, 16, 8), (128, 1280, 8, 1))):
        lay = _layout(shape, strides)
        off = 7 * strides[0] * 2 + 3 * strides[1] * 2 + 5 * strides[2] * 2 + 4
        assert lay.locate(0, off) == (7, 3)


@pytest.mark.parametrize(
    ("shape", "strides", "why"),
    [
        ((4, 2, 16, 8), (256, 128, 8, 2), "content of a token-head is not contiguous"),
        ((4, 2, 16, 8), (256, 64, 8, 1), "pages overlap"),
        ((4, 2, 16, 8), (0, 128, 8, 1), "non-positive stride"),
        ((4, 2, 16, 8), (256, 128, 8), "expected a 4-d"),
    ],
)
def test_layout_refuses_what_is_not_dense_pages(
    shape: tuple[int, ...], strides: tuple[int, ...], why: str
) -> None:
    with pytest.raises(LayoutError, match=why) as exc:
        plane_of("layer x", shape, strides, 2, "float16", "BHNC", None, 0)
    assert "layer x: shape (4, 2, 16, 8)" in str(exc.value)


def test_layout_refuses_pages_that_do_not_split_vllm_blocks() -> None:
    with pytest.raises(LayoutError, match="do not divide vLLM's block of 16"):
        _layout((10, 2, 12, 8), (192, 96, 8, 1), block_size=16)


def test_layout_refuses_blocks_and_heads_outside_the_cache() -> None:
    lay = _layout(*HEAD_MAJOR)
    with pytest.raises(LayoutError, match="D block 10"):
        pair_pieces(lay, lay, [(0, 10)], (0, 1), 0)
    with pytest.raises(LayoutError, match="D heads 3\\+2"):
        pair_pieces(lay, lay, [(0, 0)], (0, 2), 3)


def test_layout_pairing_needs_block_size_content_and_dtype_alike() -> None:
    p = _layout(*HEAD_MAJOR)
    with pytest.raises(LayoutError, match="bytes per token-head P 16 vs D 32"):
        check_compatible(p, _layout((10, 4, 16, 16), (1024, 256, 16, 1)))
    with pytest.raises(LayoutError, match="block size P 16 vs D 8"):
        check_compatible(p, _layout((10, 4, 8, 8), (256, 64, 8, 1)))
    plane = p.planes[0]
    other = LayerLayout(10, 4, 16, (msgspec.structs.replace(plane, dtype="bfloat16"),))
    with pytest.raises(LayoutError, match="dtype of plane 0: P float16 vs D bfloat16"):
        check_compatible(p, other)


def test_layout_one_tensor_and_separate_k_v_do_not_pair() -> None:
    """The content is opaque: K|V in one tensor vs K and V apart cannot be matched."""
    single, _ = describe_layer("l", torch.zeros(4, 2, 16, 16, dtype=torch.float16), 16)
    kv = (
        torch.zeros(4, 16, 2, 8, dtype=torch.float16),
        torch.zeros(4, 16, 2, 8, dtype=torch.float16),
    )
    split, _ = describe_layer("l", kv, 16)
    assert single.head_bytes == split.head_bytes == 32
    with pytest.raises(LayoutError, match=r"planes \(content start, bytes\) P \[\(0, 32\)\]"):
        check_compatible(single, split)


def test_layout_interleaved_layers_use_the_real_block_stride() -> None:
    buf = torch.zeros(2 * 6 * 2 * 16 * 8, dtype=torch.float32)  # blocks outer, layers inner
    page = 2 * 16 * 8
    views = {
        f"l{i}": torch.as_strided(buf, (6, 2, 16, 8), (2 * page, 16 * 8, 8, 1), i * page)
        for i in range(2)
    }
    mem = KVMemory.of(views)
    assert len(mem.layouts) == 1 and mem.layouts[0].planes[0].block_stride == 2 * page * 4
    assert mem.regions() == [(buf.data_ptr(), (5 * 2 * page + 2 * page) * 4)]
    off = pair_pieces(mem.layouts[0], mem.layouts[0], [(3, 3)], (0, 2), 0)[0].src
    views["l1"][3].fill_(1.0)
    assert buf[(mem.bases[1][0] - buf.data_ptr() + off) // 4] == 1.0


def test_memory_refuses_raw_buffers_state_lists_and_old_5d_caches_naming_the_layer() -> None:
    with pytest.raises(
        LayoutError, match=r"layer mamba: shape \(4096,\) strides \(1,\).*raw buffer"
    ):
        KVMemory.of({"mamba": torch.zeros(4096, dtype=torch.int8)})
    with pytest.raises(LayoutError, match="layer old: shape \\(2, 4, 16, 2, 8\\).*before 0.32"):
        KVMemory.of({"old": torch.zeros(2, 4, 16, 2, 8)})
    states = [torch.zeros(4, 3, 64), torch.zeros(4, 2, 16, 16)]  # vllm-ascend's Mamba layer
    with pytest.raises(LayoutError, match=r"layer gdn: a list of 2 state tensors \(\(4, 3, 64\)"):
        KVMemory.of({"gdn": states})
    parts = (torch.zeros(4, 16, 2, 8), torch.zeros(5, 16, 2, 8))
    with pytest.raises(LayoutError, match="layer kv part 1: 5 blocks x 2 heads"):
        KVMemory.of({"kv": parts})


def test_memory_keeps_one_layout_per_distinct_layer_shape() -> None:
    caches = {
        "a": torch.zeros(4, 1, 16, 576, dtype=torch.bfloat16),  # MLA latent
        "b": torch.zeros(4, 1, 16, 576, dtype=torch.bfloat16),
        "idx": torch.zeros(4, 1, 16, 132, dtype=torch.uint8),  # an indexer's keys
    }
    mem = KVMemory.of(caches, 16)
    assert mem.layer_layout == [0, 0, 1] and len(mem.layouts) == 2
    assert mem.layout(2).planes[0].dtype == "uint8"


Leg = tuple[int, int, int, int, int]  # (D rank, P head start, heads, D head start, expected)


@pytest.mark.parametrize(
    ("heads", "p_tp", "d_tp", "mla", "table"),
    [
        # P tp >= D tp: each P rank writes its heads into one D rank; replicas write nothing
        (
            8,
            4,
            1,
            False,
            [[(0, 0, 2, 0, 4)], [(0, 0, 2, 2, 4)], [(0, 0, 2, 4, 4)], [(0, 0, 2, 6, 4)]],
        ),
        (
            8,
            4,
            2,
            False,
            [[(0, 0, 2, 0, 2)], [(0, 0, 2, 2, 2)], [(1, 0, 2, 0, 2)], [(1, 0, 2, 2, 2)]],
        ),
        (2, 4, 1, False, [[(0, 0, 1, 0, 2)], [], [(0, 0, 1, 1, 2)], []]),
        (2, 8, 2, False, [[(0, 0, 1, 0, 1)], [], [], [], [(1, 0, 1, 0, 1)], [], [], []]),
        (8, 4, 2, True, [[(0, 0, 1, 0, 1)], [(1, 0, 1, 0, 1)], [], []]),
        (8, 2, 2, True, [[(0, 0, 1, 0, 1)], [(1, 0, 1, 0, 1)]]),
        # D tp > P tp, D tp <= heads: P's heads split over D's ranks
        (8, 1, 2, False, [[(0, 0, 4, 0, 1), (1, 4, 4, 0, 1)]]),
        (8, 2, 4, False, [[(0, 0, 2, 0, 1), (1, 2, 2, 0, 1)], [(2, 0, 2, 0, 1), (3, 2, 2, 0, 1)]]),
        # D tp > heads: each head replicated into every D rank holding it
        (2, 1, 4, False, [[(0, 0, 1, 0, 1), (1, 0, 1, 0, 1), (2, 1, 1, 0, 1), (3, 1, 1, 0, 1)]]),
        (1, 2, 4, False, [[(0, 0, 1, 0, 1), (2, 0, 1, 0, 1)], [(1, 0, 1, 0, 1), (3, 0, 1, 0, 1)]]),
        # MLA: the latent into every D rank, the writes spread over P's ranks
        (8, 1, 4, True, [[(d, 0, 1, 0, 1) for d in range(4)]]),
        (8, 2, 4, True, [[(0, 0, 1, 0, 1), (2, 0, 1, 0, 1)], [(1, 0, 1, 0, 1), (3, 0, 1, 0, 1)]]),
    ],
)
def test_tp_routes(heads: int, p_tp: int, d_tp: int, mla: bool, table: list[list[Leg]]) -> None:
    got = [
        [(r.d_rank, r.p_head_start, r.num_heads, r.d_head_start, r.expected) for r in legs]
        for legs in (tp.routes(rank, p_tp, d_tp, heads, mla) for rank in range(p_tp))
    ]
    assert got == table


@pytest.mark.parametrize("mla", [False, True], ids=["gqa", "mla"])
@pytest.mark.parametrize("heads", [1, 2, 4, 8])
@pytest.mark.parametrize("p_tp", [1, 2, 4, 8])
@pytest.mark.parametrize("d_tp", [1, 2, 4, 8])
def test_tp_every_d_head_written_once_and_signals_counted(
    d_tp: int, p_tp: int, heads: int, mla: bool
) -> None:
    """Whatever the pairing: each head of each D rank has exactly one writer, that writer holds
    the head, and each D rank expects as many signals as ranks write into it."""
    h = 1 if mla else heads
    writes: dict[tuple[int, int], int] = {}  # (D rank, local head) -> writers
    into: dict[int, set[int]] = {}
    for p in range(p_tp):
        p_start, p_count = tp.heads_of(p, p_tp, h)
        for leg in tp.routes(p, p_tp, d_tp, heads, mla):
            assert 0 <= leg.p_head_start and leg.p_head_start + leg.num_heads <= p_count
            d_start, _ = tp.heads_of(leg.d_rank, d_tp, h)
            for k in range(leg.num_heads):
                assert p_start + leg.p_head_start + k == d_start + leg.d_head_start + k
                key = (leg.d_rank, leg.d_head_start + k)
                writes[key] = writes.get(key, 0) + 1
            into.setdefault(leg.d_rank, set()).add(p)
            assert leg.expected == tp.expected_signals(leg.d_rank, p_tp, d_tp, heads, mla)
    for d in range(d_tp):
        assert [writes.get((d, k)) for k in range(tp.heads_of(d, d_tp, h)[1])] == [1] * (
            tp.heads_of(d, d_tp, h)[1]
        )
        assert len(into[d]) == tp.expected_signals(d, p_tp, d_tp, heads, mla)


def test_tp_refuses_sizes_that_do_not_divide_with_the_reason() -> None:
    with pytest.raises(LayoutError, match="one must divide the other"):
        tp.routes(0, 3, 2, 8, False)
    with pytest.raises(LayoutError, match="8 KV heads do not split over tp 3"):
        tp.check_pairing(1, 3, 8, False)
    tp.check_pairing(1, 3, None, False)  # heads not known: the sizes alone
    tp.check_pairing(1, 2, 8, False)
