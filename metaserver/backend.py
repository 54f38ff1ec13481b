"""The backend: the three pieces of state the metaserver serves from, built side by side on one
medium by one factory (``create_backend``): the store (bindings and the instance registry), the
KV-event index and the proxies' load board.

``memory``: one process's dicts (the load board lapses reports on the store's clock). A Redis
URL: one connection pool (``RedisLink``) that all three share, under one namespace; the store
owns it and closes it. None of the three hands out another: whoever needs the KV index or the
load board gets it from the backend, beside the store.
"""

from __future__ import annotations

from dataclasses import dataclass

from metaserver.kvindex.index import PLACED_S, KVIndex, MemoryKVIndex
from metaserver.kvindex.redis_index import RedisKVIndex
from metaserver.load.board import LoadBoard
from metaserver.load.memory import MemoryLoadBoard
from metaserver.load.redis import RedisLoadBoard
from metaserver.store.base import Store
from metaserver.store.memory import MemoryStore
from metaserver.store.redis import RedisStore
from metaserver.store.redis_pool import RedisLink

MEMORY_URLS = ("memory", "memory://")
REDIS_SCHEMES = ("redis://", "rediss://", "unix://", "redis+sentinel://", "rediss+sentinel://")


@dataclass(frozen=True, slots=True)
class Backend:
    store: Store
    kv_index: KVIndex
    load_board: LoadBoard

    @property
    def description(self) -> str:
        return self.store.description

    async def start(self) -> None:
        """Open what the pieces need (the store's change listener)."""
        await self.store.start()

    async def close(self) -> None:
        """Release it, and the connection the three share."""
        await self.store.close()


def memory_backend(store: MemoryStore, *, kv_placed_s: float = PLACED_S) -> Backend:
    """One process's backend around ``store``; its load board runs on the store's clock."""
    return Backend(store, MemoryKVIndex(placed_s=kv_placed_s), MemoryLoadBoard(store.clock))


def redis_backend(
    url: str,
    *,
    namespace: str,
    binding_ttl_s: float,
    retain_s: float,
    kv_placed_s: float = PLACED_S,
) -> Backend:
    """The backend every metaserver replica on this Redis (and ``namespace``) shares."""
    link = RedisLink(url)
    store = RedisStore(
        url, namespace=namespace, binding_ttl_s=binding_ttl_s, retain_s=retain_s, link=link
    )
    index = RedisKVIndex(link.client, namespace, placed_s=kv_placed_s)
    return Backend(store, index, RedisLoadBoard(link.client, namespace))


def create_backend(
    url: str,
    *,
    namespace: str = "pdgate",
    binding_ttl_s: float = 600.0,
    retain_s: float = 900.0,
    kv_placed_s: float = PLACED_S,
) -> Backend:
    """``memory``, a ``redis://`` (``rediss://``, ``unix://``) URL or a ``redis+sentinel://``
    URL (``--store``); ``ValueError`` for anything else."""
    if url in MEMORY_URLS:
        store = MemoryStore(binding_ttl_s=binding_ttl_s, retain_s=retain_s)
        return memory_backend(store, kv_placed_s=kv_placed_s)
    if url.startswith(REDIS_SCHEMES):
        return redis_backend(
            url,
            namespace=namespace,
            binding_ttl_s=binding_ttl_s,
            retain_s=retain_s,
            kv_placed_s=kv_placed_s,
        )
    raise ValueError(
        f"unknown store {url!r}: use 'memory', a redis:// URL or a redis+sentinel:// URL"
    )


def create_store(
    url: str, *, namespace: str = "pdgate", binding_ttl_s: float = 600.0, retain_s: float = 900.0
) -> Store:
    """The store of ``create_backend(url, ...)`` alone (closing it closes its connection)."""
    backend = create_backend(
        url, namespace=namespace, binding_ttl_s=binding_ttl_s, retain_s=retain_s
    )
    return backend.store
