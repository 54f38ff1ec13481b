"""Redis store: shared state for any number of stateless metaserver replicas.

* One Redis, or a master found through Sentinels (``redis+sentinel://``, redis_pool.py).
* Keys live under one namespace (``<ns>:b:<id>`` binding hash, ``<ns>:e:<id>`` its events,
  ``<ns>:bidx`` creation index, ``<ns>:i:<id>`` instances, ``<ns>:iidx``, ``<ns>:lat``).
* TTLs are Redis's own (PEXPIRE), so records expire even when no metaserver runs.
* Each write is one Lua script: check, change, publish — atomic across replicas.
* Connection errors are retried with exponential backoff + jitter inside redis-py; if Redis stays
  unreachable the call raises ``StoreUnavailable`` (HTTP 503) and later calls recover by
  themselves once Redis is back.
* Long-polls: one pub/sub connection per process listens on ``<ns>:changes`` and wakes local
  waiters; after a reconnect every waiter is woken to re-read (no change is missed).
* Binding feeds: the same connection listens on ``<ns>:created``, where a new binding is
  published whole (``_created``), so a feed sends it without reading it back; a lost
  subscription tells the feeds (they end, and their readers fall back to long-polls).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from typing import Any

import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import ExponentialWithJitterBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisError
from redis.exceptions import TimeoutError as RedisTimeoutError

from metaserver.errors import Conflict, Forbidden, NotFound, StoreUnavailable, Unprocessable
from metaserver.kvindex.index import PLACED_S, KVIndex
from metaserver.kvindex.redis_index import RedisKVIndex
from metaserver.loadboard import LoadBoard, RedisLoadBoard
from metaserver.store import redis_scripts as lua
from metaserver.store.base import (
    MAX_EVENTS,
    BindingPut,
    ChangeSubscription,
    CreatedListener,
    EventPut,
    InstancePut,
    LocalWaiters,
    OpenTransfers,
    PutOutcome,
    Store,
    StoredBinding,
    StoredInstance,
    StoreStats,
    decode_instance_problem,
    not_its_step,
    not_prefill,
    open_transfers_of,
    taken,
)
from metaserver.store.redis_batch import ScriptBatcher
from metaserver.store.redis_pool import close_pool, make_pool
from pdservice.settings import redact_url
from pdwire.models import BindingState, MarkKind

log = logging.getLogger("pdgate.metaserver.redis")
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
        max_connections: int = 64,
        retries: int = 3,
        socket_timeout_s: float = 2.0,
        kv_placed_s: float = PLACED_S,
    ) -> None:
        self.description = f"redis ({redact_url(url)}, namespace {namespace!r})"
        self._ns = namespace
        self._ttl_ms = str(int(binding_ttl_s * 1000))
        self._retain_ms = str(int(retain_s * 1000))
        self._max_age_s = binding_ttl_s + retain_s
        self._channel = f"{namespace}:changes"
        self._created_channel = f"{namespace}:created"
        self._created_raw = self._created_channel.encode()
        retry = Retry(ExponentialWithJitterBackoff(base=0.02, cap=0.25), retries)
        self._pool = make_pool(
            url,
            max_connections=max_connections,
            timeout=socket_timeout_s,
            socket_timeout=socket_timeout_s,
            socket_connect_timeout=socket_timeout_s,
            retry=retry,
            retry_on_error=[RedisConnectionError, RedisTimeoutError],
            health_check_interval=10,
        )
        self._r = aioredis.Redis(connection_pool=self._pool)
        self._kv_index: RedisKVIndex | None = None
        self._kv_placed_s = kv_placed_s
        self._load_board = RedisLoadBoard(self._r, namespace)
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
        self._listener: asyncio.Task[None] | None = None
        self.subscribed = asyncio.Event()  # set once Redis confirms the change subscription
        self.bad_messages = 0  # change messages that could not be read (dropped, logged)

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
        self._listener = asyncio.create_task(self._listen(), name="metaserver-pubsub")

    async def close(self) -> None:
        if self._listener is not None:
            await _cancel_until_done(self._listener)
        await self._r.aclose()
        await close_pool(self._pool)

    def load_board(self) -> LoadBoard:
        return self._load_board

    def kv_index(self) -> KVIndex:
        if self._kv_index is None:
            self._kv_index = RedisKVIndex(self._r, self._ns, placed_s=self._kv_placed_s)
        return self._kv_index

    async def ping(self) -> None:
        await self._call(self._r.ping)

    async def _call(self, fn: Callable[..., Awaitable[Any]], *args: Any, **kwargs: Any) -> Any:
        try:
            return await fn(*args, **kwargs)
        except (RedisConnectionError, RedisTimeoutError, OSError) as exc:
            raise StoreUnavailable(f"redis unreachable: {exc}") from exc
        except RedisError as exc:
            raise StoreUnavailable(f"redis error: {exc}") from exc

    async def _listen(self) -> None:
        """Feed local waiters from the change channel; reconnect forever with backoff."""
        delay = 0.05
        while True:
            pubsub = self._r.pubsub()
            try:
                # SUBSCRIBE is only sent here; Redis may still run a PUBLISH from another
                # connection before it. The subscription is live at its confirmation message.
                await pubsub.subscribe(self._channel, self._created_channel)
                confirmed = 0
                async for message in pubsub.listen():
                    kind = message.get("type")
                    if kind == "message":
                        self._deliver(message)
                    elif kind == "subscribe" and (confirmed := confirmed + 1) == 2:
                        self.subscribed.set()
                        if delay > 0.05:
                            log.info("change subscription restored")
                        delay = 0.05
                        self._waiters.notify_all()  # anything may have changed while away
                    elif kind == "subscribe" and confirmed > 2:
                        # redis-py reconnected and subscribed again by itself: what was
                        # published meanwhile is gone
                        log.warning("change subscription re-established; waking every waiter")
                        self._waiters.lost()
                        self._waiters.notify_all()
            except asyncio.CancelledError:
                with contextlib.suppress(Exception):
                    await pubsub.aclose()  # type: ignore[no-untyped-call]
                raise
            except (RedisError, OSError) as exc:
                self.subscribed.clear()
                self._waiters.lost()
                log.warning("change subscription lost (%s); retrying in %.2fs", exc, delay)
            except Exception:  # a bug here must not end every long-poll's wake-ups for good
                self.subscribed.clear()
                self._waiters.lost()
                log.exception("change listener failed; subscribing again in %.2fs", delay)
            finally:
                with contextlib.suppress(Exception):
                    await pubsub.aclose()  # type: ignore[no-untyped-call]
            await asyncio.sleep(delay)
            delay = min(delay * 2, 2.0)
            self._waiters.notify_all()

    def _deliver(self, message: dict[str, Any]) -> None:
        """Wake the waiters a change message names. Anyone who can PUBLISH on the channel can
        send anything: a message that cannot be read is counted and logged, and every waiter
        is woken to read its binding again (a wake-up it needed may have been in it)."""
        try:
            if message["channel"] == self._created_raw:
                self._waiters.created(_created(message["data"]))
            else:
                self._waiters.notify(message["data"].decode())
        except Exception as exc:
            self.bad_messages += 1
            log.warning("unreadable change message %.80r dropped (%r)", message.get("data"), exc)
            self._waiters.notify_all()

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
        return outcome, _binding(tid, res)

    async def get_binding(self, transfer_id: str) -> StoredBinding | None:
        res = await self._batch.call(
            self._read_binding, [self._bkey(transfer_id), self._ekey(transfer_id)], []
        )
        return None if res[0] == b"notfound" else _binding(transfer_id, res)

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
                rec = _binding(raw.decode(), res)
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
        return _binding(transfer_id, res)

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
        h = await self._call(self._r.hmget, self._ikey(instance_id), _INSTANCE_FIELDS)
        return _instance(instance_id, h)

    async def set_draining(self, instance_id: str, draining: bool) -> StoredInstance | None:
        res = await self._call(
            self._set_drain, keys=[self._ikey(instance_id)], args=["1" if draining else ""]
        )
        return None if res[0] == b"notfound" else _instance(instance_id, res[1:])

    async def list_instances(self, role: str | None) -> list[StoredInstance]:

        idx = f"{self._ns}:iidx"
        await self._call(self._r.zremrangebyscore, idx, "-inf", repr(time.time()))
        ids = await self._call(self._r.zrange, idx, 0, -1)
        async with self._r.pipeline(transaction=False) as pipe:
            for raw in ids:
                pipe.hmget(self._ikey(raw.decode()), _INSTANCE_FIELDS)
            rows = await self._call(pipe.execute)
        out = [
            inst
            for raw, h in zip(ids, rows, strict=True)
            if (inst := _instance(raw.decode(), h)) is not None
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


def _created(data: bytes) -> StoredBinding:
    """A ``<ns>:created`` message (PUT_BINDING): id, instance, time, first event, spec."""
    tid, inst, created, event, spec = data.split(b"\n", 4)
    at = float(created)
    return StoredBinding(tid.decode(), spec, BindingState.BOUND, inst.decode(), at, at, (event,))


_MARKS = len(MarkKind)


def _binding(transfer_id: str, res: list[Any]) -> StoredBinding:
    _, spec, state, inst, created, updated, *rest = res
    marks = tuple(m for m in rest[:_MARKS] if m is not None)
    events = rest[_MARKS:]
    return StoredBinding(
        transfer_id=transfer_id,
        spec_json=spec,
        state=BindingState(state.decode()),
        decode_instance_id=inst.decode(),
        created_at=float(created),
        updated_at=float(updated),
        events=tuple(events),
        marks=marks,
    )


_INSTANCE_FIELDS = ["spec", "role", "reg", "hb", "exp", "drain"]


def _instance(instance_id: str, h: list[Any]) -> StoredInstance | None:
    spec, role, reg, hb, exp, drain = h
    if spec is None:
        return None
    return StoredInstance(
        instance_id, spec, role.decode(), float(reg), float(hb), float(exp), bool(drain)
    )


_RECANCEL_S = 0.1


async def _cancel_until_done(task: asyncio.Task[None]) -> None:
    """Cancel ``task`` and wait for it to end, cancelling again while it runs on. On Python
    3.11 ``asyncio.wait_for`` loses a cancel that lands as the call it waits on completes
    (CPython gh-86296, fixed in 3.12); redis-py sends commands through it, so a listener
    cancelled while it subscribed went on to read its subscription for good, and ``close``
    waited for it for ever (a hung CI run; 5 of 120 closes that came 0-30 ms after the start
    hung in ``tests/metaserver/test_redis_store.py`` before this)."""
    while not task.done():
        task.cancel()
        await asyncio.wait((task,), timeout=_RECANCEL_S)
    with contextlib.suppress(asyncio.CancelledError):
        await task
