"""How a tcp write is cut into batches that fit Mooncake's per-peer queue
(``connector/transport/mooncake.py::batches``): pure, no engine needed."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from connector.transport.mooncake import batches

SLICE = 64 * 1024


def test_batches_small_pieces_fill_each_batch_to_the_allowance() -> None:
    assert batches([128] * 2112, SLICE, 512) == [
        range(512), range(512, 1024), range(1024, 1536), range(1536, 2048), range(2048, 2112)
    ]  # fmt: skip


def test_batches_count_a_long_piece_as_its_slices() -> None:
    # 3 slices, then 2 + 1 would be 3 more: the allowance of 4 cuts after the first two pieces
    assert batches([3 * SLICE, SLICE, 2 * SLICE, SLICE], SLICE, 4) == [range(2), range(2, 4)]


def test_batches_a_piece_over_the_allowance_goes_alone() -> None:
    assert batches([10 * SLICE, 1], SLICE, 4) == [range(1), range(1, 2)]


def test_batches_nothing_to_write_is_no_batch() -> None:
    assert batches([], SLICE, 4) == []


@given(
    st.lists(st.integers(min_value=1, max_value=5 * SLICE), max_size=300),
    st.integers(min_value=1, max_value=40),
)
def test_batches_cover_every_piece_once_in_order_within_the_allowance(
    lengths: list[int], allowance: int
) -> None:
    got = batches(lengths, SLICE, allowance)
    assert [i for r in got for i in r] == list(range(len(lengths)))
    for r in got:
        slices = sum(max(1, -(-lengths[i] // SLICE)) for i in r)
        assert len(r) == 1 or slices <= allowance
