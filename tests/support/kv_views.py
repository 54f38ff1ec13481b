"""KV caches as vLLM and vllm-ascend hand them to a connector, built without either installed.

``vllm_views`` mirrors vLLM 0.32/0.33 for one group of full-attention (or MLA) layers: the
planner's ``KVCacheTensor`` strides (``vllm/v1/core/kv_cache_utils.py``,
``get_kv_cache_config_from_groups``: block stride ``L * page`` when blocks are outermost) and
the per-layer ``[B, H, N, C]`` views of one int8 buffer (``vllm/v1/kv_cache_interface.py``,
``compute_layout_strides`` / ``create_kv_cache_views``, kernel-block split included).
``tests/connector/test_kv_views.py`` checks it against vLLM's own code for every
``KVCacheLayout`` member; the GPU scripts (no vLLM there) use it to build CUDA tensors.

``ascend_views`` mirrors vllm-ascend v0.23.0 (commit 5cb98caa, ``vllm_ascend/worker/
model_runner_v1.py``, ``NPUModelRunner._allocate_kv_cache_tensors`` and
``_reshape_kv_cache_tensors``): per layer a tuple of separate tensors ``[B, N, H, D]`` — K and
V (or MLA's latent and rope parts, DSA's indexer) — each in its own int8 buffer whose start is
aligned to 2 MiB (``_allocate_int8_cache_tensor`` / ``_align_memory``, used whenever a KV
connector is configured); with several KV-cache groups a block is split into kernel blocks.
"""

from __future__ import annotations

from typing import Any

import torch

# vllm/v1/kv_cache_layout.py: physical order of the logical axes [L, B, H, N, C]
LAYOUTS: dict[str, tuple[int, ...]] = {
    "LBHNC": (0, 1, 2, 3, 4),
    "LBNHC": (0, 1, 3, 2, 4),
    "LHBNC": (0, 2, 1, 3, 4),
    "BLHNC": (1, 0, 2, 3, 4),
    "BLNHC": (1, 0, 3, 2, 4),
    "BHLNC": (1, 2, 0, 3, 4),
}
ALIGN = 2 << 20  # vllm-ascend: KV buffers start on a 2 MiB boundary


def _strides(shape: tuple[int, ...], order: tuple[int, ...], fixed: list[int | None]) -> list[int]:
    """``compute_layout_strides``: dense from the innermost physical axis out, except the
    fixed ones (bytes, logical axis order)."""
    strides = [0] * 5
    current = 1
    for dim in reversed(order):
        strides[dim] = fixed[dim] or current
        current = strides[dim] * shape[dim]
    return strides


def vllm_views(
    layout: str,
    layers: list[str],
    *,
    blocks: int,
    heads: int,
    head_size: int,
    block_size: int = 16,
    dtype: torch.dtype = torch.float16,
    mla: bool = False,
    kernel_block_size: int | None = None,
    device: str | torch.device = "cpu",
) -> dict[str, torch.Tensor]:
    """One ``[B, H, N, C]`` view per layer of one int8 allocation, as vLLM makes them.
    ``mla``: one head whose content is the latent (``head_size`` elements, no V)."""
    order = LAYOUTS[layout]
    count = len(layers)
    content = head_size * (1 if mla else 2) * dtype.itemsize
    h = 1 if mla else heads
    page = h * block_size * content
    block_outer = order[0] == 1
    # the planner: KVCacheTensor(layer_stride, block_stride)
    layer_stride, block_stride = _strides(
        (count, blocks, h, block_size, content),
        order,
        [None, count * page if block_outer else None, None, None, None],
    )[:2]
    buf = torch.zeros(count * blocks * page, dtype=torch.int8, device=device)
    n, b = block_size, blocks
    if kernel_block_size is not None and kernel_block_size != block_size:
        ratio = block_size // kernel_block_size
        if block_stride != page:
            raise ValueError(f"{layout} does not store blocks as dense pages: no kernel split")
        n, b, block_stride = kernel_block_size, blocks * ratio, block_stride // ratio
    shape = (count, b, h, n, content)
    strides = _strides(shape, order, [layer_stride, block_stride, None, None, None])
    view = torch.as_strided(buf, shape, strides, buf.storage_offset())
    return {name: view[i].view(dtype) for i, name in enumerate(layers)}


def _aligned(nbytes: int, device: str | torch.device) -> torch.Tensor:
    raw = torch.zeros(nbytes + ALIGN, dtype=torch.int8, device=device)
    skip = (-raw.data_ptr()) % ALIGN
    return raw[skip : skip + nbytes]


def ascend_views(
    layers: list[str],
    *,
    blocks: int,
    heads: int,
    head_size: int,
    block_size: int = 128,
    dtype: torch.dtype = torch.bfloat16,
    kind: str = "gqa",
    kernel_block_size: int | None = None,
    device: str | torch.device = "cpu",
) -> dict[str, tuple[torch.Tensor, ...]]:
    """Per layer the tuple vllm-ascend hands ``register_kv_caches``.

    ``kind``: ``gqa`` — ``(k, v)``, each ``[B, N, H, D]``; ``mla`` — ``(latent, rope)`` with
    ``head_size`` latent and ``head_size // 8`` rope elements per token (DeepSeek: 512 / 64),
    one head; ``dsa`` — MLA plus the indexer's keys (``head_size // 4``: 128).
    """
    if kind == "gqa":
        dims = [head_size, head_size]
    elif kind in ("mla", "dsa"):
        heads = 1
        dims = [head_size, head_size // 8] + ([head_size // 4] if kind == "dsa" else [])
    else:
        raise ValueError(kind)
    n, b = block_size, blocks
    if kernel_block_size is not None and kernel_block_size != block_size:
        n, b = kernel_block_size, blocks * (block_size // kernel_block_size)
    out: dict[str, tuple[torch.Tensor, ...]] = {}
    for name in layers:
        parts: list[Any] = []
        for d in dims:
            raw = _aligned(blocks * block_size * heads * d * dtype.itemsize, device)
            parts.append(raw.view(dtype).view(b, n, heads, d))
        out[name] = tuple(parts)
    return out


def logical(part: torch.Tensor, split: bool) -> torch.Tensor:
    """A cache tensor as ``[B, H, N, C]``: vLLM's views are already; vllm-ascend's parts are
    ``[B, N, H, D]``."""
    return part.permute(0, 2, 1, 3) if split else part


def block(part: torch.Tensor, index: int, block_size: int) -> torch.Tensor:
    """vLLM block ``index`` of a ``[B, H, N, C]`` tensor as ``[H, block_size, C]`` (its
    kernel blocks, when smaller, put back in token order)."""
    ratio = block_size // part.shape[2]
    pages = part.unflatten(0, (-1, ratio))[index]  # [ratio, H, Nk, C]
    return pages.permute(1, 0, 2, 3).reshape(part.shape[1], block_size, part.shape[3])
