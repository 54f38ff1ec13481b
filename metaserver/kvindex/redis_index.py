"""The KV-event index in Redis: one SET of 8-byte block keys per instance, shared by every
metaserver replica (``<ns>:kv:<instance>``, and ``<ns>:kvi`` listing the indexed instances).

Writes are pipelined in event order; a store goes through a script that respects the per-instance
bound. Each key carries a TTL that the following metaserver renews (``touch``), so an index
nobody follows any more expires by itself. Placed keys (``KVIndex.place``) go in one sorted
set per instance (``<ns>:kvp:<instance>``), scored by the wall time until which they count
(every metaserver replica compares alike), lapsed ones trimmed on each placement. A match is one
script call: the prompt's keys sent once, each candidate's lookup stopping at its first key it
neither holds nor had placed (a made-up prompt costs one lookup per candidate). The scripts are
``kvindex.redis_scripts``.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Sequence

import redis.asyncio as aioredis
from redis.exceptions import RedisError

from metaserver.errors import StoreUnavailable
from metaserver.kvindex import redis_scripts as lua
from metaserver.kvindex.index import DEFAULT_MAX_BLOCKS, PLACED_S, Change, KVIndex, Op, Placement

_CHUNK = 1000  # keys per command (Lua's stack bounds the script's arguments)


def _member(key: int) -> bytes:
    return key.to_bytes(8, "big")


class RedisKVIndex(KVIndex):
    def __init__(
        self,
        r: aioredis.Redis,
        namespace: str,
        *,
        ttl_s: float = 600.0,
        max_blocks: int = DEFAULT_MAX_BLOCKS,
        clock: Callable[[], float] = time.time,
        placed_s: float = PLACED_S,
    ) -> None:
        self.description = f"redis (namespace {namespace!r})"
        self._r = r
        self._ns = namespace
        self._ttl_ms = int(ttl_s * 1000)
        self._max = max_blocks
        self._placed_s = placed_s
        self._store = r.register_script(lua.STORE)
        self._lead = r.register_script(lua.LEAD)
        self._match = r.register_script(lua.MATCH)
        self._dropped = 0
        self._clock = clock  # wall time: every metaserver replica buckets alike

    def _key(self, instance_id: str) -> str:
        return f"{self._ns}:kv:{instance_id}"

    def _placed_key(self, instance_id: str) -> str:
        return f"{self._ns}:kvp:{instance_id}"

    async def apply(self, instance_id: str, changes: Sequence[Change]) -> None:
        key = self._key(instance_id)
        try:
            async with self._r.pipeline(transaction=False) as pipe:
                pipe.sadd(f"{self._ns}:kvi", instance_id)
                scripts: list[int] = []  # positions of the store scripts' replies
                calls = 1
                for change in changes:
                    if change.op is Op.CLEAR:  # and what was placed before it
                        pipe.delete(key, self._placed_key(instance_id))
                        calls += 1
                        continue
                    for i in range(0, len(change.keys), _CHUNK):
                        members = [_member(k) for k in change.keys[i : i + _CHUNK]]
                        if change.op is Op.STORE:
                            await self._store(  # queued in the pipeline
                                keys=[key], args=[self._max, self._ttl_ms, *members], client=pipe
                            )
                            scripts.append(calls)
                        else:
                            pipe.srem(key, *members)
                        calls += 1
                results = await pipe.execute()
        except RedisError as exc:
            raise StoreUnavailable(f"KV index: {exc}") from exc
        self._dropped += sum(int(results[i]) for i in scripts)

    async def drop(self, instance_id: str) -> None:
        try:
            async with self._r.pipeline(transaction=False) as pipe:
                pipe.delete(self._key(instance_id), self._placed_key(instance_id))
                pipe.srem(f"{self._ns}:kvi", instance_id)
                await pipe.execute()
        except RedisError as exc:
            raise StoreUnavailable(f"KV index: {exc}") from exc

    async def place(self, placements: Sequence[Placement]) -> None:
        placements = [p for p in placements if p.keys]
        if not placements:
            return
        now = self._clock()
        until = now + self._placed_s
        try:  # one pipeline: Redis on appendfsync always waits for its disk once, not per item
            async with self._r.pipeline(transaction=False) as pipe:
                for p in placements:
                    key = self._placed_key(p.instance)
                    for i in range(0, len(p.keys), _CHUNK):
                        chunk = p.keys[i : i + _CHUNK]
                        pipe.zadd(key, dict.fromkeys((_member(k) for k in chunk), until))
                    pipe.zremrangebyscore(key, "-inf", now)
                    pipe.pexpire(key, int(self._placed_s * 1000) + 1000)
                await pipe.execute()
        except RedisError as exc:
            raise StoreUnavailable(f"KV index: {exc}") from exc

    async def lead(self, me: str, ttl_s: float) -> bool:
        try:
            won = await self._lead(keys=[f"{self._ns}:kvlead"], args=[me, int(ttl_s * 1000)])
        except RedisError as exc:
            raise StoreUnavailable(f"KV index: {exc}") from exc
        return bool(won)

    async def touch(self, instance_id: str) -> None:
        """Renew the instance's entries' TTL (the follower does, while it follows)."""
        try:
            await self._r.pexpire(self._key(instance_id), self._ttl_ms)
        except RedisError as exc:
            raise StoreUnavailable(f"KV index: {exc}") from exc

    async def match(
        self, keys: Sequence[int], instance_ids: Iterable[str], placed: bool = True
    ) -> dict[str, int]:
        ids = list(instance_ids)
        if not keys or not ids:
            return dict.fromkeys(ids, 0)
        sets = [k for iid in ids for k in (self._key(iid), self._placed_key(iid))]
        args: list[bytes | str | float] = [repr(self._clock()), "1" if placed else ""]
        args += [_member(k) for k in keys]
        try:
            found = await self._match(keys=sets, args=args)
        except RedisError as exc:
            raise StoreUnavailable(f"KV index: {exc}") from exc
        return {iid: int(n) for iid, n in zip(ids, found, strict=True)}

    async def sizes(self) -> dict[str, int]:
        try:
            members = await self._r.smembers(f"{self._ns}:kvi")
            ids = sorted(m.decode() if isinstance(m, bytes) else m for m in members)
            async with self._r.pipeline(transaction=False) as pipe:
                for iid in ids:
                    pipe.scard(self._key(iid))
                counts = await pipe.execute()
        except RedisError as exc:
            raise StoreUnavailable(f"KV index: {exc}") from exc
        return {iid: int(n) for iid, n in zip(ids, counts, strict=True) if n}

    @property
    def dropped(self) -> int:
        return self._dropped
