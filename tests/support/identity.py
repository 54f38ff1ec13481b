"""A KV-compatibility identity for tests that pair instances (pdwire.models.KVIdentity)."""

from __future__ import annotations

from pdwire.models import KVIdentity

KV = KVIdentity(
    model="sha256:" + "a" * 32,
    dtype="bfloat16",
    kv_cache_dtype="bfloat16",
    block_size=16,
    head_size=128,
    num_kv_heads=8,
    num_layers=32,
    protocol=1,
)
