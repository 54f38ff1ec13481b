"""The KV-event index: which engine holds which prefix-cache block, from vLLM's own KV events.

``index``: the interface and the in-memory index; ``redis_index``: the same in Redis, shared by
every metaserver replica (its scripts in ``redis_scripts``); ``follower``: one engine's event
stream (sequence numbers, replay of gaps); ``manager``: follows every registered engine that
publishes events; ``streams``: the instances the index answers about; ``routes``: the HTTP edge.
The backend (``metaserver.backend``) builds the index beside the store, on the same medium.
"""

from metaserver.kvindex.index import Change, KVIndex, MemoryKVIndex, Op, Placement

__all__ = ["Change", "KVIndex", "MemoryKVIndex", "Op", "Placement"]
