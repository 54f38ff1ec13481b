"""Stores behind one interface: ``create_store("memory")`` or ``create_store("redis://…")``."""

from __future__ import annotations

from metaserver.kvindex.index import PLACED_S
from metaserver.store.base import Store, StoredBinding, StoredInstance
from metaserver.store.memory import MemoryStore

__all__ = ["MemoryStore", "Store", "StoredBinding", "StoredInstance", "create_store"]


def create_store(
    url: str,
    *,
    namespace: str = "pdgate",
    binding_ttl_s: float = 600.0,
    retain_s: float = 900.0,
    kv_placed_s: float = PLACED_S,
) -> Store:
    if url in ("memory", "memory://"):
        return MemoryStore(binding_ttl_s=binding_ttl_s, retain_s=retain_s, kv_placed_s=kv_placed_s)
    if url.startswith(
        ("redis://", "rediss://", "unix://", "redis+sentinel://", "rediss+sentinel://")
    ):
        from metaserver.store.redis import RedisStore

        return RedisStore(
            url,
            namespace=namespace,
            binding_ttl_s=binding_ttl_s,
            retain_s=retain_s,
            kv_placed_s=kv_placed_s,
        )
    raise ValueError(
        f"unknown store {url!r}: use 'memory', a redis:// URL or a redis+sentinel:// URL"
    )
