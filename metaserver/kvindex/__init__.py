"""The KV-event index: which engine holds which prefix-cache block, from vLLM's own KV events.

``index``: the interface and the in-memory index; ``redis_index``: the same in Redis, shared by
every metaserver replica; ``follower``: one engine's event stream (sequence numbers, replay of
gaps); ``manager``: follows every registered engine that publishes events.
"""

from metaserver.kvindex.index import Change, KVIndex, MemoryKVIndex, Op, Placement

__all__ = ["Change", "KVIndex", "MemoryKVIndex", "Op", "Placement"]
