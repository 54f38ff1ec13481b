"""vLLM's KV cache events as they arrive on the wire, and the index key of a block hash.

An engine started with ``--kv-events-config '{"enable_kv_cache_events": true, ...}'`` publishes
over ZeroMQ: a PUB socket sends ``(topic, seq, payload)`` per batch, ``seq`` an 8-byte big-endian
counter; a ROUTER replay socket answers ``(b"", start_seq)`` with every buffered batch from
``start_seq`` on, then ``(b"", b"", END_SEQ, b"")``. ``payload`` is msgpack of an array
``[ts, events, data_parallel_rank]`` whose events are maps tagged by ``type``. Derived from
vLLM 0.32's ``vllm/distributed/kv_events.py`` (``ZmqEventPublisher``, ``KVEventBatch``,
``BlockStored``, ``BlockRemoved``, ``AllBlocksCleared``); fields this reader does not use are
ignored, so newer engines that add fields still parse.
"""

from __future__ import annotations

import msgspec

END_SEQ = (-1).to_bytes(8, "big", signed=True)
CACHE_MEDIUM = "GPU"  # vLLM names the engine's own KV cache so on every device (CPU included)


class BlockStored(msgspec.Struct, tag=True):
    block_hashes: list[bytes | int]
    block_size: int = 0
    medium: str | None = None


class BlockRemoved(msgspec.Struct, tag=True):
    block_hashes: list[bytes | int]
    medium: str | None = None


class AllBlocksCleared(msgspec.Struct, tag=True):
    pass


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared


class EventBatch(msgspec.Struct, array_like=True):
    ts: float
    events: list[KVEvent]
    data_parallel_rank: int | None = None


_batch = msgspec.msgpack.Decoder(EventBatch)


def decode_batch(payload: bytes) -> EventBatch:
    """Raises ``msgspec.DecodeError`` (a ``ValueError``) on a payload that is not a batch."""
    return _batch.decode(payload)


def seq_of(frame: bytes) -> int:
    return int.from_bytes(frame, "big", signed=True)


def seq_frame(seq: int) -> bytes:
    return seq.to_bytes(8, "big", signed=True)


def block_key(block_hash: bytes | int) -> int:
    """The index key of a block hash: its low 64 bits. vLLM publishes the full hash as bytes,
    or (``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1``) as exactly these 64 bits, so both forms give
    the same key; a proxy computing the hash itself (``pdwire.block_hash``) keys it alike."""
    if isinstance(block_hash, int):
        return block_hash & 0xFFFF_FFFF_FFFF_FFFF
    return int.from_bytes(block_hash[-8:], "big")


def is_cache_event(medium: str | None) -> bool:
    """Events of the engine's own cache (not of an offloading tier's)."""
    return medium is None or medium == CACHE_MEDIUM
