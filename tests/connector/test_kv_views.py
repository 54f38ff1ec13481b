"""The vLLM-free view builder of the GPU scripts (tests/support/kv_views.py) makes exactly the
tensors vLLM's own planner and allocator make, for every layout member."""

from __future__ import annotations

import pytest
import torch

from tests.connector.vllm_kv import LAYOUTS, planned
from tests.support import kv_views

LAYERS = [f"model.layers.{i}.self_attn.attn" for i in range(3)]


def _same(ours: dict[str, torch.Tensor], theirs: dict[str, torch.Tensor]) -> None:
    assert list(ours) == list(theirs)
    for name in LAYERS:
        a, b = ours[name], theirs[name]
        assert (a.shape, a.stride(), a.dtype) == (b.shape, b.stride(), b.dtype), name
        assert a.storage_offset() * a.element_size() == b.storage_offset() * b.element_size()
        assert a.untyped_storage().nbytes() == b.untyped_storage().nbytes()


@pytest.mark.parametrize("mla", [False, True], ids=["gqa", "mla"])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_kv_views_match_vllm_allocation(layout: str, mla: bool) -> None:
    kw = {"blocks": 7, "heads": 4, "head_size": 24 if mla else 8, "mla": mla}
    _same(kv_views.vllm_views(layout, LAYERS, **kw), planned(layout, LAYERS, **kw))  # type: ignore[arg-type]


@pytest.mark.parametrize("layout", ["LBHNC", "LBNHC"])
def test_kv_views_match_vllm_kernel_block_split(layout: str) -> None:
    kw = {"blocks": 5, "heads": 2, "head_size": 8, "kernel_block_size": 4}
    ours = kv_views.vllm_views(layout, LAYERS, **kw)  # type: ignore[arg-type]
    assert ours[LAYERS[0]].shape[:3] == (20, 2, 4)
    _same(ours, planned(layout, LAYERS, **kw))  # type: ignore[arg-type]


def test_kv_views_block_puts_kernel_blocks_back_in_token_order() -> None:
    whole = kv_views.vllm_views("LBNHC", ["l"], blocks=3, heads=2, head_size=4)["l"]
    split = kv_views.vllm_views(
        "LBNHC", ["l"], blocks=3, heads=2, head_size=4, kernel_block_size=4
    )["l"]
    whole.copy_(torch.randn(whole.shape).half())
    for b in range(3):  # the same tokens, written through the split view
        for k in range(4):
            split[b * 4 + k].copy_(whole[b][:, k * 4 : (k + 1) * 4])
    for b in range(3):
        assert torch.equal(kv_views.block(split, b, 16), whole[b])
