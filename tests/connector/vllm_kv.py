"""KV caches from vLLM's own planner and allocator, on CPU memory, in any ``KVCacheLayout``.

``get_kv_cache_config_from_groups`` places the layers (``KVCacheTensor`` strides for the
layout), ``allocate_kv_cache`` makes the per-layer ``[B, H, N, C]`` views — the tensors an
engine hands ``register_kv_caches``, on every platform in vLLM 0.32.
"""

from __future__ import annotations

import torch
from vllm.config import CacheConfig, VllmConfig
from vllm.v1.core.kv_cache_utils import get_kv_cache_config_from_groups
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheGroupSpec, MLAAttentionSpec
from vllm.v1.kv_cache_layout import KVCacheLayout
from vllm.v1.worker.utils import allocate_kv_cache

LAYOUTS = [member.name for member in KVCacheLayout]


def planned(
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
) -> dict[str, torch.Tensor]:
    cache = CacheConfig(num_gpu_blocks_override=blocks)
    cache.kv_cache_layout = layout  # what the engine core resolves once
    config = VllmConfig(cache_config=cache)
    spec: FullAttentionSpec = (
        MLAAttentionSpec(block_size=block_size, num_kv_heads=1, head_size=head_size, dtype=dtype)
        if mla
        else FullAttentionSpec(
            block_size=block_size, num_kv_heads=heads, head_size=head_size, dtype=dtype
        )
    )
    kv_config = get_kv_cache_config_from_groups(config, [KVCacheGroupSpec(layers, spec)], 1 << 40)
    kernel = [kernel_block_size] if kernel_block_size else None
    caches: dict[str, torch.Tensor] = allocate_kv_cache(
        kv_config, torch.device("cpu"), KVCacheLayout[layout], kernel
    )
    return caches
