"""Bindings and the instance registry behind one interface (``base.Store``), in memory
(``memory``) or in Redis (``redis``, with its scripts, connection, listener and pipelining in the
``redis_*`` modules). ``records``: what is stored and the writes that store it; ``rules``: what
every store checks atomically; ``waiters``: the long-polls and feeds a store wakes. The backend
(``metaserver.backend``) builds a store, with the KV index and the load board beside it."""

from metaserver.store.base import Store
from metaserver.store.memory import MemoryStore
from metaserver.store.records import StoredBinding, StoredInstance

__all__ = ["MemoryStore", "Store", "StoredBinding", "StoredInstance"]
