"""Byte regions per backend layout, coalescing, and the heterogeneous-TP routing table."""

from __future__ import annotations

import pytest
import torch

from connector import tp
from connector.errors import LayoutError
from connector.layout import coalesce, describe, pair_pieces
from connector.worker.memory import KVMemory


def test_layout_cpu_head_slice_is_one_run_per_block() -> None:
    lay = describe("cpu", (10, 4, 16, 128), 4)  # 16 tokens x 128 floats per head page
    page = 16 * 128 * 4
    assert lay.pieces(3, 1, 2) == [(0, 3 * 4 * page + page, 2 * page)]


def test_layout_flash_head_slice_is_one_run_per_token_and_plane() -> None:
    lay = describe("flash", (2, 10, 16, 4, 64), 2)
    got = lay.pieces(1, 2, 1)
    assert len(got) == 2 * 16 and {p for p, _, _ in got} == {0, 1}
    block = 16 * 4 * 64 * 2
    assert got[0] == (0, block + 2 * 64 * 2, 64 * 2)
    assert got[1] == (0, block + 4 * 64 * 2 + 2 * 64 * 2, 64 * 2)
    assert lay.pieces(1, 0, 4) == [(0, block, block), (1, block, block)]


def test_layout_coalesces_runs_on_both_sides_only() -> None:
    p = describe("cpu", (10, 2, 16, 8), 4)
    d = describe("cpu", (10, 2, 16, 8), 4)
    pieces = pair_pieces(p, d, [(0, 5), (1, 6), (2, 8), (7, 1)], (0, 2), 0)
    bb = p.block_bytes
    assert pieces == [(0, 0, 5 * bb, 2 * bb), (0, 2 * bb, 8 * bb, bb), (0, 7 * bb, bb, bb)]
    assert coalesce([(0, 0, 0, 4), (1, 4, 4, 4)]) == [(0, 0, 0, 4), (1, 4, 4, 4)]


def test_layout_rejects_blocks_outside_the_cache() -> None:
    lay = describe("cpu", (4, 2, 16, 8), 4)
    with pytest.raises(LayoutError):
        lay.pieces(4, 0, 1)
    with pytest.raises(LayoutError):
        describe("cpu", (4, 2, 16), 4)


def test_layout_interleaved_layers_use_the_real_block_stride() -> None:
    buf = torch.zeros(2 * 6 * 2 * 16 * 8, dtype=torch.float32)  # blocks outer, layers inner
    page = 2 * 16 * 8
    views = {
        f"l{i}": torch.as_strided(buf, (6, 2, 16, 8), (2 * page, 16 * 8, 8, 1), i * page)
        for i in range(2)
    }
    mem = KVMemory.of(views, "cpu")
    assert mem.layout.stride == 2 * page * 4
    assert mem.regions() == [(buf.data_ptr(), (5 * 2 * page + 2 * page) * 4)]
    off = mem.layout.pieces(3, 0, 2)[0][1]
    views["l1"][3].fill_(1.0)
    assert buf[(mem.bases[1][0] - buf.data_ptr() + off) // 4] == 1.0


@pytest.mark.parametrize(
    ("heads", "p_tp", "d_tp", "mla", "table"),
    [
        (8, 4, 1, False, [(0, 2, 0, 4), (0, 2, 2, 4), (0, 2, 4, 4), (0, 2, 6, 4)]),
        (8, 4, 2, False, [(0, 2, 0, 2), (0, 2, 2, 2), (1, 2, 0, 2), (1, 2, 2, 2)]),
        (2, 4, 1, False, [(0, 1, 0, 2), None, (0, 1, 1, 2), None]),
        (2, 8, 2, False, [(0, 1, 0, 1), None, None, None, (1, 1, 0, 1), None, None, None]),
        (8, 4, 2, True, [(0, 1, 0, 1), None, (1, 1, 0, 1), None]),
        (8, 2, 2, True, [(0, 1, 0, 1), (1, 1, 0, 1)]),
    ],
)
def test_tp_routes(
    heads: int, p_tp: int, d_tp: int, mla: bool, table: list[tuple[int, int, int, int] | None]
) -> None:
    got = []
    for r in range(p_tp):
        route = tp.route(r, p_tp, d_tp, heads, mla)
        got.append(
            None
            if route is None
            else (route.d_rank, route.num_heads, route.d_head_start, route.expected)
        )
    assert got == table


def test_tp_rejects_non_integer_ratio() -> None:
    with pytest.raises(LayoutError):
        tp.route(0, 3, 2, 8, False)
    with pytest.raises(LayoutError):
        tp.route(0, 1, 2, 8, False)
