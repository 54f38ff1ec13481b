"""Redis store: shared state for any number of stateless metaserver replicas.

* One Redis, or a master found through Sentinels (``redis+sentinel://``, redis_pool.py).
* Keys live under one namespace (``<ns>:b:<id>`` binding hash, ``<ns>:e:<id>`` its events,
  ``<ns>:bidx`` creation index, ``<ns>:i:<id>`` instances, ``<ns>:iidx``, ``<ns>:lat``).
* TTLs are Redis's own (PEXPIRE), so records expire even when no metaserver runs.
* Each write is one Lua script (redis_scripts.py): check, change, publish — atomic across
  replicas; script calls of one event-loop turn share a pipeline (redis_batch.py).
* Connection errors are retried with exponential backoff + jitter inside redis-py
  (``RedisLink``); if Redis stays unreachable the call raises ``StoreUnavailable`` (HTTP 503)
  and later calls recover by themselves once Redis is back.
* Long-polls and binding feeds: one pub/sub connection per process (redis_listener.py) wakes
  local waiters on ``<ns>:changes`` and hands new bindings, published whole on ``<ns>:created``,
  to the feeds.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from typing import Any

from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisError
from redis.exceptions import TimeoutError as RedisTimeoutError

from metaserver.errors import Conflict, Forbidden, NotFound, StoreUnavailable, Unprocessable
from metaserver.store import redis_scripts as lua
from metaserver.store.base import ChangeSubscription, CreatedListener, Store
from metaserver.store.records import (
    MAX_EVENTS,
    BindingPut,
    EventPut,
    InstancePut,
    OpenTransfers,
    PutOutcome,
    StoredBinding,
    StoredInstance,
    StoreStats,
    open_transfers_of,
)
from metaserver.store.redis_batch import ScriptBatcher
from metaserver.store.redis_codec import INSTANCE_FIELDS, binding_of, instance_of
from metaserver.store.redis_listener import ChangeListener
from metaserver.store.redis_pool import RedisLink
from metaserver.store.rules import decode_instance_problem, not_its_step, not_prefill, taken
from metaserver.store.waiters import LocalWaiters
from pdservice.settings import redact_url
from pdwire.models import BindingState, MarkKind

_LATENCY_SAMPLES = 1000
_LIST_PAGE = 256


class RedisStore(Store):
    def __init__(
        self,
        url: str,
        *,
        namespace: str,
        binding_ttl_s: float,
        retain_s: float,
        link: RedisLink | None = None,
    ) -> None:
        """``link``: the connection to ``url`` (the backend's, which its KV index and load board
        share); one of its own by default. The store closes it either way."""
        self.description = f"redis ({redact_url(url)}, namespace {namespace!r})"
        self._ns = namespace
        self._ttl_ms = str(int(binding_ttl_s * 1000))
        self._retain_ms = str(int(retain_s * 1000))
        self._max_age_s = binding_ttl_s + retain_s
        self._link = link or RedisLink(url)
        self._r = self._link.client
        self._put_binding = self._r.register_script(lua.PUT_BINDING)
        self._add_event = self._r.register_script(lua.ADD_EVENT)
        self._read_binding = self._r.register_script(lua.READ_BINDING)
        self._add_mark = self._r.register_script(lua.ADD_MARK)
        self._delete_binding = self._r.register_script(lua.DELETE_BINDING)
        self._put_instance = self._r.register_script(lua.PUT_INSTANCE)
        self._delete_instance = self._r.register_script(lua.DELETE_INSTANCE)
        self._set_drain = self._r.register_script(lua.SET_DRAIN)
        self._batch = ScriptBatcher(self._r)
        self._waiters = LocalWaiters()
        self._listener = ChangeListener(self._r, namespace, self._waiters)
        self._channel = self._listener.channel
        self._created_channel = self._listener.created_channel

    @property
    def subscribed(self) -> asyncio.Event:
        """Set once Redis confirms the change subscription."""
        return self._listener.subscribed

    @property
    def bad_messages(self) -> int:
        """Change messages that could not be read (dropped, logged)."""
        return self._listener.bad_messages

    # ---- keys -----------------------------------------------------------------------------
    def _bkey(self, transfer_id: str) -> str:
        return f"{self._ns}:b:{transfer_id}"

    def _ekey(self, transfer_id: str) -> str:
        return f"{self._ns}:e:{transfer_id}"

    def _ikey(self, instance_id: str) -> str:
        return f"{self._ns}:i:{instance_id}"

    def _okey(self, owner: str) -> str:
        """The instances a credential registered (``owner``: its name)."""
        return f"{self._ns}:o:{owner}"

    def _instance_indexes(self) -> tuple[str, str, str]:
        """The live instances by expiry, and who holds each URL and each KV endpoint."""
        return f"{self._ns}:iidx", f"{self._ns}:iurl", f"{self._ns}:ikv"

    # ---- lifecycle ------------------------------------------------------------------------
    async def start(self) -> None:
        self._listener.start()

    async def close(self) -> None:
        await self._listener.close()
        await self._link.close()

    async def ping(self) -> None:
        await self._call(self._r.ping)

    async def _call(self, fn: Callable[..., Awaitable[Any]], *args: Any, **kwargs: Any) -> Any:
        try:
            return await fn(*args, **kwargs)
        except (RedisConnectionError, RedisTimeoutError, OSError) as exc:
            raise StoreUnavailable(f"redis unreachable: {exc}") from exc
        except RedisError as exc:
            raise StoreUnavailable(f"redis error: {exc}") from exc

    # ---- bindings -------------------------------------------------------------------------
    async def put_binding(self, put: BindingPut, now: float) -> tuple[PutOutcome, StoredBinding]:
        tid = put.transfer_id
        res = await self._batch.call(
            self._put_binding,
            keys=[
                self._bkey(tid),
                self._ekey(tid),
                f"{self._ns}:bidx",
                self._ikey(put.decode_instance_id),
            ],
            args=[
                tid,
                put.spec_json,
                put.decode_instance_id,
                put.kv_host,
                put.kv_port,
                put.event_json,
                repr(now),
                self._ttl_ms,
                self._channel,
                repr(now - self._max_age_s),
                "1" if put.vetted else "0",
                self._created_channel,
            ],
        )
        status = res[0].decode()
        if status == "conflict":
            raise Conflict(f"binding {tid} exists with different content")
        if status in ("noinst", "prefill", "nokv", "kvmismatch"):
            found: tuple[str, tuple[str, int] | None] | None
            if status == "noinst":
                found = None
            elif status == "prefill":
                found = ("prefill", None)
            elif status == "nokv":
                found = ("decode", None)
            else:
                found = ("decode", (res[1].decode(), int(res[2])))
            raise Unprocessable(decode_instance_problem(put, found) or status)
        outcome = PutOutcome.CREATED if status == "created" else PutOutcome.SAME
        return outcome, binding_of(tid, res)

    async def get_binding(self, transfer_id: str) -> StoredBinding | None:
        res = await self._batch.call(
            self._read_binding, [self._bkey(transfer_id), self._ekey(transfer_id)], []
        )
        return None if res[0] == b"notfound" else binding_of(transfer_id, res)

    async def delete_binding(self, transfer_id: str) -> bool:
        n = await self._call(
            self._delete_binding,
            keys=[self._bkey(transfer_id), self._ekey(transfer_id)],
            args=[self._channel, transfer_id],
        )
        return bool(n)

    async def list_bindings(
        self, *, state: BindingState | None, instance_id: str | None, limit: int
    ) -> list[StoredBinding]:
        out: list[StoredBinding] = []
        start = 0
        scanned = 0
        while len(out) < limit and scanned < 50 * max(limit, _LIST_PAGE):
            ids = await self._call(
                self._r.zrevrange, f"{self._ns}:bidx", start, start + _LIST_PAGE - 1
            )
            if not ids:
                break
            start += len(ids)
            scanned += len(ids)
            results = await asyncio.gather(
                *(
                    self._batch.call(self._read_binding, [self._bkey(t), self._ekey(t)], [])
                    for t in (raw.decode() for raw in ids)
                )
            )
            for raw, res in zip(ids, results, strict=True):
                if res[0] == b"notfound":
                    continue
                rec = binding_of(raw.decode(), res)
                if state is not None and rec.state is not state:
                    continue
                if instance_id is not None and rec.decode_instance_id != instance_id:
                    continue
                out.append(rec)
                if len(out) == limit:
                    break
        return out

    async def add_event(self, put: EventPut, now: float) -> StoredBinding:
        transfer_id, state = put.transfer_id, put.state
        res = await self._batch.call(
            self._add_event,
            keys=[
                self._bkey(transfer_id), self._ekey(transfer_id), f"{self._ns}:lat",
                self._ikey(put.actor),
            ],
            args=[
                state.value, put.event_json, repr(now), self._ttl_ms, self._retain_ms,
                self._channel, transfer_id, MAX_EVENTS, _LATENCY_SAMPLES, put.actor,
                "1" if put.engine else "",
            ],
        )  # fmt: skip
        status = res[0].decode()
        if status == "notfound":
            raise NotFound(f"binding {transfer_id} not found")
        if status == "taken":
            raise taken(put, res[1].decode())
        if status == "notprefill":
            raise not_prefill(put)
        if status == "notyours":
            raise not_its_step(put)
        if status == "conflict":
            raise Conflict(
                f"binding {transfer_id} is {res[1].decode()}; cannot become {state.value}"
            )
        return binding_of(transfer_id, res)

    async def add_mark(self, transfer_id: str, kind: MarkKind, mark_json: bytes) -> bool:
        res = await self._batch.call(
            self._add_mark, [self._bkey(transfer_id)], [lua.mark_field(kind), mark_json]
        )
        if res == -1:
            raise NotFound(f"binding {transfer_id} not found")
        return bool(res)

    # ---- instances ------------------------------------------------------------------------
    async def put_instance(self, put: InstancePut, now: float) -> tuple[PutOutcome, StoredInstance]:
        expires = now + put.ttl_s
        host, port = put.kv if put.kv is not None else ("", 0)
        res = await self._call(
            self._put_instance,
            keys=[self._ikey(put.instance_id), *self._instance_indexes(), self._okey(put.owner)],
            args=[
                put.instance_id, put.spec_json, put.role, host, port, repr(now),
                int(put.ttl_s * 1000), repr(expires), put.url, self._ikey(""), put.owner,
                put.max_owned, int(time.time() * 1000),
            ],
        )  # fmt: skip
        if res[0] == b"taken":
            what, holder = res[1].decode(), res[2].decode()
            shown = put.url if what == "url" else f"{host}:{port}"
            raise Conflict(f"{what} {shown} is registered by instance {holder!r}")
        if res[0] == b"quota":
            raise Forbidden(f"credential {put.owner!r} already holds {res[1]} instances")
        outcome = PutOutcome.CREATED if res[0] == b"created" else PutOutcome.SAME
        draining = bool(res[2])
        return outcome, StoredInstance(
            put.instance_id, put.spec_json, put.role, float(res[1]), now, expires, draining
        )

    async def get_instance(self, instance_id: str) -> StoredInstance | None:
        h = await self._call(self._r.hmget, self._ikey(instance_id), INSTANCE_FIELDS)
        return instance_of(instance_id, h)

    async def set_draining(self, instance_id: str, draining: bool) -> StoredInstance | None:
        res = await self._call(
            self._set_drain, keys=[self._ikey(instance_id)], args=["1" if draining else ""]
        )
        return None if res[0] == b"notfound" else instance_of(instance_id, res[1:])

    async def list_instances(self, role: str | None) -> list[StoredInstance]:
        idx = f"{self._ns}:iidx"
        await self._call(self._r.zremrangebyscore, idx, "-inf", repr(time.time()))
        ids = await self._call(self._r.zrange, idx, 0, -1)
        async with self._r.pipeline(transaction=False) as pipe:
            for raw in ids:
                pipe.hmget(self._ikey(raw.decode()), INSTANCE_FIELDS)
            rows = await self._call(pipe.execute)
        out = [
            inst
            for raw, h in zip(ids, rows, strict=True)
            if (inst := instance_of(raw.decode(), h)) is not None
            and (role is None or inst.role == role)
        ]
        return sorted(out, key=lambda r: r.instance_id)

    async def delete_instance(self, instance_id: str) -> bool:
        n = await self._call(
            self._delete_instance,
            keys=[self._ikey(instance_id), *self._instance_indexes()],
            args=[instance_id, self._okey("")],
        )
        return bool(n)

    async def stats(self, scan_limit: int) -> StoreStats:
        ids = await self._call(self._r.zrevrange, f"{self._ns}:bidx", 0, scan_limit - 1)
        by_state: Counter[str] = Counter()
        scanned = 0
        for i in range(0, len(ids), 1000):
            async with self._r.pipeline(transaction=False) as pipe:
                for raw in ids[i : i + 1000]:
                    pipe.hget(self._bkey(raw.decode()), "state")
                states = await self._call(pipe.execute)
            for s in states:
                if s is not None:
                    by_state[s.decode()] += 1
                    scanned += 1
        lat = await self._call(self._r.lrange, f"{self._ns}:lat", 0, -1)
        roles = Counter(r.role for r in await self.list_instances(None))
        return StoreStats(dict(by_state), scanned, [float(x) for x in lat], dict(roles))

    async def open_transfers(self, scan_limit: int) -> OpenTransfers:
        ids = await self._call(self._r.zrevrange, f"{self._ns}:bidx", 0, scan_limit - 1)
        pairs: list[tuple[str, float]] = []
        for i in range(0, len(ids), 1000):
            async with self._r.pipeline(transaction=False) as pipe:
                for raw in ids[i : i + 1000]:
                    pipe.hmget(self._bkey(raw.decode()), "state", "created")
                rows = await self._call(pipe.execute)
            pairs += [(s.decode(), float(c)) for s, c in rows if s is not None and c is not None]
        return open_transfers_of(pairs)

    def changes(self, transfer_id: str) -> ChangeSubscription:
        return self._waiters.subscribe(transfer_id)

    def watch_created(self, listener: CreatedListener) -> Callable[[], None]:
        return self._waiters.watch_created(listener)

    async def notifications_live(self) -> None:
        await self.subscribed.wait()
