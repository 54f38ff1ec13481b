"""One engine's KV event stream into the index.

A SUB socket receives ``(topic, seq, payload)``. The follower keeps the next sequence number it
expects: a batch already seen (a replay overlapping the live stream) is skipped; a gap is asked
again from the engine's replay socket (``ZmqEventPublisher``'s ROUTER). When replay cannot give
every missed batch (no replay socket, a timeout, or the engine's buffer already moved past them)
the instance's entries are dropped and rebuilt from what replay still holds: the index may then
miss blocks, but never names one the engine evicted. A batch numbered below the next expected
one but published after the last one applied comes from a restarted engine (its count starts
again at 0, its cache is empty): the same rebuild. On start the follower replays from 0, so a
metaserver that starts after its engines learns what they already hold.

A frame over ``MAX_EVENT_BYTES`` is not read: ZeroMQ drops the connection, and does not
reconnect a socket it dropped for that, so the follower starts over (a new socket, a rebuild)
whenever its connection drops, at most every ``RECONNECT_S``.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field

import msgspec
import zmq
import zmq.asyncio

from metaserver.kvindex.index import Change, KVIndex, Op
from pdwire.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventBatch,
    block_key,
    decode_batch,
    is_cache_event,
    seq_frame,
    seq_of,
)

log = logging.getLogger("pdgate.metaserver.kvindex")
REPLAY_TIMEOUT_S = 5.0
# The largest frame read from an engine (ZeroMQ drops a peer that sends more, before buffering
# it whole): vLLM publishes one batch per engine step, about 16 bytes per token whose block it
# stores (block hash, parent hash, token ids), so this is a step of a million tokens
MAX_EVENT_BYTES = 16 << 20
RECONNECT_S = 0.5


@dataclass(frozen=True, slots=True)
class Source:
    """Where an instance publishes (``pdwire.models.KVEvents``, host resolved)."""

    endpoint: str
    replay_endpoint: str | None
    topic: str


@dataclass(slots=True)
class FollowerStats:
    batches: int = 0
    skipped: int = 0  # seen already
    replays: int = 0
    rebuilds: int = 0  # events lost: entries dropped and rebuilt
    bad: int = 0  # payloads that were not event batches
    last_seq: int = -1
    reconnects: int = 0  # connections dropped (an engine restart, or a frame over the cap)


def changes_of(batch: EventBatch) -> list[Change]:
    """The index changes of one batch."""
    out: list[Change] = []
    for ev in batch.events:
        if isinstance(ev, BlockStored):
            if is_cache_event(ev.medium):
                out.append(Change(Op.STORE, [block_key(h) for h in ev.block_hashes]))
        elif isinstance(ev, BlockRemoved):
            if is_cache_event(ev.medium):
                out.append(Change(Op.REMOVE, [block_key(h) for h in ev.block_hashes]))
        elif isinstance(ev, AllBlocksCleared):
            out.append(Change(Op.CLEAR))
    return out


@dataclass
class Follower:
    instance_id: str
    source: Source
    index: KVIndex
    ctx: zmq.asyncio.Context
    replay_timeout_s: float = REPLAY_TIMEOUT_S
    stats: FollowerStats = field(default_factory=FollowerStats)
    _next: int | None = None
    _last_ts: float = 0.0  # publication time of the newest batch applied

    async def run(self) -> None:
        log.info("following KV events of %s at %s", self.instance_id, self.source.endpoint)
        first = True
        while True:
            await self._follow(first)
            first = False
            self.stats.reconnects += 1
            log.warning(
                "KV events of %s: the connection to %s dropped (the engine restarted, or sent "
                "a frame over %d bytes); reconnecting and rebuilding its entries",
                self.instance_id, self.source.endpoint, MAX_EVENT_BYTES,
            )  # fmt: skip
            await asyncio.sleep(RECONNECT_S)

    async def _follow(self, first: bool) -> None:
        """Follow on one connection, until it drops."""
        sub = self.ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.MAXMSGSIZE, MAX_EVENT_BYTES)
        sub.setsockopt(zmq.SUBSCRIBE, self.source.topic.encode())
        monitor = sub.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        sub.connect(self.source.endpoint)
        poller = zmq.asyncio.Poller()
        poller.register(sub, zmq.POLLIN)
        poller.register(monitor, zmq.POLLIN)
        try:
            await self._rebuild(first=first)
            while True:
                ready = dict(await poller.poll())
                if sub in ready:
                    frames = await sub.recv_multipart()
                    if len(frames) != 3:
                        self.stats.bad += 1
                        continue
                    await self._on_batch(seq_of(frames[1]), frames[2])
                elif monitor in ready:
                    await monitor.recv_multipart()  # disconnected
                    return
        finally:
            sub.disable_monitor()
            monitor.close(0)
            sub.close(0)

    async def _on_batch(self, seq: int, payload: bytes) -> None:
        batch = _decoded(payload)
        expected = self._next
        if expected is not None and seq < expected:
            # published after the last batch applied: not a repeat but a restarted publisher's
            # (its count starts again at 0; its first batches may miss a reconnecting subscriber)
            if batch is not None and batch.ts > self._last_ts:
                log.info("KV events of %s start again at %d: rebuilding", self.instance_id, seq)
                await self.index.drop(self.instance_id)
                self._next = None
                await self._apply(seq, batch)
                return
            self.stats.skipped += 1  # seen already (a replay overlapping the live stream)
            return
        if expected is not None and seq > expected:
            await self._catch_up(expected)
            if self._next is not None and seq < self._next:
                self.stats.skipped += 1
                return
        await self._apply(seq, batch)

    async def _apply(self, seq: int, batch: EventBatch | None) -> None:
        """Apply batch ``seq`` (``None``: its payload was not an event batch)."""
        changes = []
        if batch is None:
            self.stats.bad += 1
            log.warning("KV events of %s: batch %d is not an event batch", self.instance_id, seq)
        else:
            self._last_ts = max(self._last_ts, batch.ts)
            changes = changes_of(batch)
        if changes:
            await self.index.apply(self.instance_id, changes)
        self.stats.batches += 1
        self.stats.last_seq = seq
        self._next = seq + 1

    async def _catch_up(self, start: int) -> None:
        """Batches ``start``… from the replay socket; a rebuild where they are gone."""
        batches = await self._replay(start)
        if batches is None or not batches or batches[0][0] != start:
            log.warning(
                "KV events of %s: batches from %d lost: rebuilding its entries",
                self.instance_id, start,
            )  # fmt: skip
            await self._rebuild(first=False)
            return
        for seq, payload in batches:
            await self._apply(seq, _decoded(payload))

    async def _rebuild(self, *, first: bool) -> None:
        await self.index.drop(self.instance_id)
        if not first:
            self.stats.rebuilds += 1
        self._next = None
        for seq, payload in await self._replay(0) or []:
            await self._apply(seq, _decoded(payload))

    async def _replay(self, start: int) -> list[tuple[int, bytes]] | None:
        """Every buffered batch from ``start`` (``None``: no replay socket, or no answer)."""
        if self.source.replay_endpoint is None:
            return None
        self.stats.replays += 1
        sock = self.ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.MAXMSGSIZE, MAX_EVENT_BYTES)
        sock.connect(self.source.replay_endpoint)
        out: list[tuple[int, bytes]] = []
        try:
            await sock.send_multipart((b"", seq_frame(start)))
            while True:
                if not await sock.poll(int(self.replay_timeout_s * 1000)):
                    log.warning("KV events of %s: replay timed out", self.instance_id)
                    return None
                frames = await sock.recv_multipart()
                if len(frames) != 4:
                    continue
                seq = seq_of(frames[2])
                if seq == -1:
                    return out
                out.append((seq, frames[3]))
        finally:
            sock.close(0)


def _decoded(payload: bytes) -> EventBatch | None:
    try:
        return decode_batch(payload)
    except msgspec.DecodeError:
        return None
