"""In-process store: the embedded default for a single metaserver process (and for tests).

Expiry is lazy (checked on access) plus a sweep, so memory stays bounded by the live records. The
sweep never scans the live bindings: a heap holds one ``(expires, id)`` per binding, a write pops
the ones due, and a binding whose expiry moved on since (each event extends it) goes back in with
its new one. Instances (a handful) are scanned every few hundred writes. Not shared between
processes: use Redis for replicas.
"""

from __future__ import annotations

import heapq
import time
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass, field, replace

from metaserver.errors import Conflict, Forbidden, NotFound, Unprocessable
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
from metaserver.store.rules import check_transition, decode_instance_problem, owner_problem
from metaserver.store.waiters import LocalWaiters
from pdwire.models import BindingState, MarkKind

Clock = Callable[[], float]
_SWEEP_EVERY = 512
_LATENCY_SAMPLES = 1000


@dataclass(slots=True)
class _Instance:
    record: StoredInstance
    kv: tuple[str, int] | None
    expires: float
    url: str = ""
    owner: str = ""


@dataclass(slots=True)
class _Binding:
    record: StoredBinding
    expires: float
    events: list[bytes] = field(default_factory=list)
    marks: dict[MarkKind, bytes] = field(default_factory=dict)
    holder: str | None = None  # the actor whose prefill_started took the lease


class MemoryStore(Store):
    description = "memory"

    def __init__(
        self,
        *,
        binding_ttl_s: float,
        retain_s: float,
        clock: Clock = time.time,
    ) -> None:
        self._binding_ttl = binding_ttl_s
        self._retain = retain_s
        self._clock = clock
        self._bindings: dict[str, _Binding] = {}
        self._instances: dict[str, _Instance] = {}
        # who holds each URL and KV endpoint, and each credential's instances (id -> expiry);
        # stale entries are checked against the live registration before they count
        self._by_url: dict[str, str] = {}
        self._by_kv: dict[tuple[str, int], str] = {}
        self._owned: dict[str, dict[str, float]] = {}
        self._latencies: deque[float] = deque(maxlen=_LATENCY_SAMPLES)
        self._writes = 0
        self._due: list[tuple[float, str]] = []  # a heap: the bindings by (past) expiry
        self._waiters = LocalWaiters()

    @property
    def clock(self) -> Clock:
        """The time its TTLs run on (the memory backend's load board lapses reports on it too)."""
        return self._clock

    async def ping(self) -> None:
        return None

    # ---- bindings -------------------------------------------------------------------------
    def _live_binding(self, transfer_id: str) -> _Binding | None:
        entry = self._bindings.get(transfer_id)
        if entry is not None and entry.expires <= self._clock():
            del self._bindings[transfer_id]
            return None
        return entry

    def _live_instance(self, instance_id: str) -> _Instance | None:
        entry = self._instances.get(instance_id)
        if entry is not None and entry.expires <= self._clock():
            del self._instances[instance_id]
            return None
        return entry

    def _sweep(self) -> None:
        """Drop the bindings whose time is up: O(log n) per binding dropped, nothing per live
        one; the instances every ``_SWEEP_EVERY`` writes."""
        now = self._clock()
        due, bindings = self._due, self._bindings
        while due and due[0][0] <= now:
            _, key = heapq.heappop(due)
            entry = bindings.get(key)
            if entry is None:
                continue  # deleted, or dropped on access
            if entry.expires <= now:
                del bindings[key]
            else:  # an event extended it: wait for its new expiry
                heapq.heappush(due, (entry.expires, key))
        self._writes += 1
        if self._writes % _SWEEP_EVERY == 0:
            for key in [k for k, v in self._instances.items() if v.expires <= now]:
                del self._instances[key]
            self._reindex(now)

    def _reindex(self, now: float) -> None:
        """Forget URLs, KV endpoints and owned ids that no live registration holds."""
        live = self._instances
        self._by_url = {e.url: k for k, e in live.items()}
        self._by_kv = {e.kv: k for k, e in live.items() if e.kv is not None}
        for owner in list(self._owned):
            owned = {i: t for i, t in self._owned[owner].items() if t > now and i in live}
            if owned:
                self._owned[owner] = owned
            else:
                del self._owned[owner]

    async def put_binding(self, put: BindingPut, now: float) -> tuple[PutOutcome, StoredBinding]:
        existing = self._live_binding(put.transfer_id)
        if existing is not None:
            if existing.record.spec_json == put.spec_json:
                return PutOutcome.SAME, existing.record
            raise Conflict(f"binding {put.transfer_id} exists with different content")
        if not put.vetted:
            instance = self._live_instance(put.decode_instance_id)
            problem = decode_instance_problem(
                put, None if instance is None else (instance.record.role, instance.kv)
            )
            if problem is not None:
                raise Unprocessable(problem)
        record = StoredBinding(
            transfer_id=put.transfer_id,
            spec_json=put.spec_json,
            state=BindingState.BOUND,
            decode_instance_id=put.decode_instance_id,
            created_at=now,
            updated_at=now,
            events=(put.event_json,),
        )
        expires = self._clock() + self._binding_ttl
        self._bindings[put.transfer_id] = _Binding(record, expires, [put.event_json])
        heapq.heappush(self._due, (expires, put.transfer_id))
        self._sweep()
        self._waiters.created(record)
        return PutOutcome.CREATED, record

    async def get_binding(self, transfer_id: str) -> StoredBinding | None:
        entry = self._live_binding(transfer_id)
        return None if entry is None else entry.record

    async def delete_binding(self, transfer_id: str) -> bool:
        found = self._live_binding(transfer_id) is not None
        self._bindings.pop(transfer_id, None)
        if found:
            self._waiters.notify(transfer_id)
        return found

    async def list_bindings(
        self, *, state: BindingState | None, instance_id: str | None, limit: int
    ) -> list[StoredBinding]:
        now = self._clock()
        out: list[StoredBinding] = []
        for entry in reversed(self._bindings.values()):
            if entry.expires <= now:
                continue
            rec = entry.record
            if state is not None and rec.state is not state:
                continue
            if instance_id is not None and rec.decode_instance_id != instance_id:
                continue
            out.append(rec)
        out.sort(key=lambda r: r.created_at, reverse=True)
        return out[:limit]

    async def add_event(self, put: EventPut, now: float) -> StoredBinding:
        transfer_id, state, event_json = put.transfer_id, put.state, put.event_json
        entry = self._live_binding(transfer_id)
        if entry is None:
            raise NotFound(f"binding {transfer_id} not found")
        actor = self._live_instance(put.actor) if put.engine else None
        problem = owner_problem(
            put, entry.record.state, entry.record.decode_instance_id, entry.holder,
            None if actor is None else actor.record.role,
        )  # fmt: skip
        if problem is not None:
            raise problem
        verdict = check_transition(entry.record.state, state)
        if verdict == "conflict":
            raise Conflict(
                f"binding {transfer_id} is {entry.record.state.value}; cannot become {state.value}"
            )
        if verdict == "duplicate":
            return entry.record
        events = entry.events
        if (
            len(events) >= MAX_EVENTS
            and state is BindingState.PUSHING
            and (entry.record.state is BindingState.PUSHING)
        ):
            events[-1] = event_json
        else:
            events.append(event_json)
        entry.record = replace(entry.record, state=state, updated_at=now, events=tuple(events))
        if state is BindingState.PREFILL_STARTED:
            entry.holder = put.actor
        ttl = self._retain if state.terminal else self._binding_ttl
        entry.expires = self._clock() + ttl
        if state is BindingState.DONE:
            self._latencies.append(now - entry.record.created_at)
        self._waiters.notify(transfer_id)
        return entry.record

    async def add_mark(self, transfer_id: str, kind: MarkKind, mark_json: bytes) -> bool:
        entry = self._live_binding(transfer_id)
        if entry is None:
            raise NotFound(f"binding {transfer_id} not found")
        if kind in entry.marks:
            return False
        entry.marks[kind] = mark_json
        marks = tuple(entry.marks[k] for k in MarkKind if k in entry.marks)
        entry.record = replace(entry.record, marks=marks)
        return True

    # ---- instances ------------------------------------------------------------------------
    async def put_instance(self, put: InstancePut, now: float) -> tuple[PutOutcome, StoredInstance]:
        iid = put.instance_id
        url_holder = self._by_url.get(put.url)
        if url_holder not in (None, iid) and self._holds(url_holder, put.url, None):
            raise Conflict(f"url {put.url} is registered by instance {url_holder!r}")
        kv_holder = None if put.kv is None else self._by_kv.get(put.kv)
        if kv_holder not in (None, iid) and self._holds(kv_holder, None, put.kv):
            host, port = put.kv or ("", 0)
            raise Conflict(f"kv_endpoint {host}:{port} is registered by instance {kv_holder!r}")
        owned = self._owned.setdefault(put.owner, {}) if put.owner else None
        if owned is not None and put.max_owned and iid not in owned:
            for other in [o for o, until in owned.items() if until <= self._clock()]:
                del owned[other]
            if len(owned) >= put.max_owned:
                raise Forbidden(f"credential {put.owner!r} already holds {len(owned)} instances")
        existing = self._live_instance(iid)
        if existing is not None:  # a move frees its old URL and KV endpoint at once
            if self._by_url.get(existing.url) == iid:
                del self._by_url[existing.url]
            if existing.kv is not None and self._by_kv.get(existing.kv) == iid:
                del self._by_kv[existing.kv]
        registered = now if existing is None else existing.record.registered_at
        draining = existing is not None and existing.record.draining
        record = StoredInstance(
            iid, put.spec_json, put.role, registered, now, now + put.ttl_s, draining
        )
        expires = self._clock() + put.ttl_s
        self._instances[iid] = _Instance(record, put.kv, expires, put.url, put.owner)
        self._by_url[put.url] = iid
        if put.kv is not None:
            self._by_kv[put.kv] = iid
        if owned is not None:
            owned[iid] = expires
        self._sweep()
        return (PutOutcome.CREATED if existing is None else PutOutcome.SAME), record

    def _holds(self, iid: str | None, url: str | None, kv: tuple[str, int] | None) -> bool:
        """Whether ``iid`` is live and still registered with this URL (or KV endpoint)."""
        entry = None if iid is None else self._live_instance(iid)
        if entry is None:
            return False
        return entry.url == url if url is not None else entry.kv == kv

    async def get_instance(self, instance_id: str) -> StoredInstance | None:
        entry = self._live_instance(instance_id)
        return None if entry is None else entry.record

    async def list_instances(self, role: str | None) -> list[StoredInstance]:
        out = []
        for key in list(self._instances):
            entry = self._live_instance(key)
            if entry is not None and (role is None or entry.record.role == role):
                out.append(entry.record)
        return sorted(out, key=lambda r: r.instance_id)

    async def delete_instance(self, instance_id: str) -> bool:
        entry = self._live_instance(instance_id)
        self._instances.pop(instance_id, None)
        if entry is not None:
            self._owned.get(entry.owner, {}).pop(instance_id, None)
        return entry is not None

    async def set_draining(self, instance_id: str, draining: bool) -> StoredInstance | None:
        entry = self._live_instance(instance_id)
        if entry is None:
            return None
        entry.record = replace(entry.record, draining=draining)
        return entry.record

    async def stats(self, scan_limit: int) -> StoreStats:
        recent = await self.list_bindings(state=None, instance_id=None, limit=scan_limit)
        by_state = Counter(r.state.value for r in recent)
        roles = Counter(r.role for r in await self.list_instances(None))
        return StoreStats(dict(by_state), len(recent), list(self._latencies), dict(roles))

    async def open_transfers(self, scan_limit: int) -> OpenTransfers:
        recent = await self.list_bindings(state=None, instance_id=None, limit=scan_limit)
        return open_transfers_of((r.state.value, r.created_at) for r in recent)

    def changes(self, transfer_id: str) -> ChangeSubscription:
        return self._waiters.subscribe(transfer_id)

    def watch_created(self, listener: CreatedListener) -> Callable[[], None]:
        return self._waiters.watch_created(listener)
