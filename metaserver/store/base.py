"""The ``Store`` interface: everything the HTTP layer needs from persistence.

Records are kept as pre-serialised JSON pieces so a read never re-encodes: a binding is its
canonical spec JSON (as validated at the edge) plus state, times and an event list.
"""

from __future__ import annotations

import abc
import asyncio
import enum
import json
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from metaserver.errors import Conflict, Forbidden
from metaserver.kvindex.index import KVIndex
from metaserver.loadboard import LoadBoard
from pdwire.models import BindingSpec, BindingState, InstanceSpec, MarkKind

# Told of each binding created from now on, on any replica sharing the store; ``None`` when
# notifications may have been missed (the store's subscription was interrupted).
CreatedListener = Callable[["StoredBinding | None"], None]

# Past this many events, consecutive ``pushing`` events are folded into the last one.
MAX_EVENTS = 64


class PutOutcome(enum.Enum):
    CREATED = "created"
    SAME = "same"


@dataclass(frozen=True, slots=True)
class StoredBinding:
    transfer_id: str
    spec_json: bytes
    state: BindingState
    decode_instance_id: str
    created_at: float
    updated_at: float
    events: tuple[bytes, ...]
    marks: tuple[bytes, ...] = ()  # in ``MarkKind`` order, each kind at most once

    def to_json(self) -> bytes:
        head = (
            f'{{"transfer_id":"{self.transfer_id}","state":"{self.state.value}",'
            f'"created_at":{self.created_at!r},"updated_at":{self.updated_at!r},'
        ).encode()
        body = head + self.spec_json[1:-1] + b',"events":[' + b",".join(self.events) + b"]"
        if self.marks:  # absent while empty: a reader of an older release rejects the key
            body += b',"marks":[' + b",".join(self.marks) + b"]"
        return body + b"}"


@dataclass(frozen=True, slots=True)
class StoredInstance:
    instance_id: str
    spec_json: bytes
    role: str
    registered_at: float
    last_heartbeat: float
    expires_at: float
    draining: bool = False  # kept across heartbeats; forgotten with the registration

    def to_json(self) -> bytes:
        head = (
            f'{{"instance_id":"{self.instance_id}","registered_at":{self.registered_at!r},'
            f'"last_heartbeat":{self.last_heartbeat!r},"expires_at":{self.expires_at!r},'
            f'"draining":{"true" if self.draining else "false"},'
        ).encode()
        return head + self.spec_json[1:-1] + b"}"


@dataclass(frozen=True, slots=True)
class BindingPut:
    """A validated PUT, with the fields the store must check atomically."""

    transfer_id: str
    spec_json: bytes
    decode_instance_id: str
    kv_host: str
    kv_port: int
    event_json: bytes
    vetted: bool = False  # the caller already checked the decode endpoint (ascend compat)

    @classmethod
    def of(cls, transfer_id: str, spec: BindingSpec, now: float) -> BindingPut:
        return cls(
            transfer_id=transfer_id,
            spec_json=spec.model_dump_json().encode(),
            decode_instance_id=spec.decode_instance_id,
            kv_host=spec.kv_endpoint.host,
            kv_port=spec.kv_endpoint.port,
            event_json=event_json(BindingState.BOUND, spec.decode_instance_id, now, None),
        )


@dataclass(frozen=True, slots=True)
class EventPut:
    """A validated state change, with who posts it: the store checks atomically that the step
    is the actor's to take (``owner_problem``)."""

    transfer_id: str
    state: BindingState
    actor: str
    event_json: bytes
    engine: bool = False  # an engine credential posts it: the actor must own the step


def owner_problem(
    put: EventPut, state: BindingState, decode: str, holder: str | None, actor_role: str | None
) -> Conflict | Forbidden | None:
    """Whose step ``put`` is, on a binding in ``state`` naming ``decode``, whose lease
    ``holder`` took (``None``: nobody yet). P's lease (``prefill_started``) is exclusive in every
    access mode: a second claimant gets 409. An engine's other steps are its own: ``pushing`` and
    ``done`` the holder's, ``failed`` the holder's or the decode's, ``aborted`` the decode's; and
    only a registered prefill (or both-role) instance takes a lease. ``actor_role``: the actor's
    registered role, ``None`` when it is not registered."""
    actor = put.actor
    if put.state is BindingState.PREFILL_STARTED:
        if holder not in (None, actor) or (holder is None and state is not BindingState.BOUND):
            return taken(put, holder)
        if put.engine and actor_role not in ("prefill", "both"):
            return not_prefill(put)
        return None
    if not put.engine:
        return None
    unknown = holder is None and state is not BindingState.BOUND  # taken before holders were kept
    mine = actor == holder or unknown
    allowed = {
        BindingState.PUSHING: mine,
        BindingState.DONE: mine,
        BindingState.FAILED: mine or actor == decode,
        BindingState.ABORTED: actor == decode,
    }.get(put.state, False)
    return None if allowed else not_its_step(put)


def taken(put: EventPut, holder: str | None) -> Conflict:
    return Conflict(f"binding {put.transfer_id} was taken by {holder or 'another prefill'}")


def not_prefill(put: EventPut) -> Forbidden:
    return Forbidden(f"{put.actor!r} is not a registered prefill instance: it takes no lease")


def not_its_step(put: EventPut) -> Forbidden:
    what = f"{put.state.value} on binding {put.transfer_id}"
    return Forbidden(f"{put.actor!r} may not post {what}: not its step")


@dataclass(frozen=True, slots=True)
class InstancePut:
    """A validated registration (or heartbeat), with what the store checks atomically: no other
    live instance has this URL or KV endpoint, and the registering credential (``owner``) holds
    at most ``max_owned`` live instances."""

    instance_id: str
    spec_json: bytes
    role: str
    url: str
    kv: tuple[str, int] | None
    ttl_s: float
    owner: str = ""  # the credential's name ('' : not counted, as for an admin)
    max_owned: int = 0  # 0: no cap

    @classmethod
    def of(
        cls, instance_id: str, spec: InstanceSpec, ttl_s: float, owner: str = "",
        max_owned: int = 0, spec_json: bytes | None = None,
    ) -> InstancePut:  # fmt: skip
        kv = None if spec.kv_endpoint is None else (spec.kv_endpoint.host, spec.kv_endpoint.port)
        body = spec.model_dump_json().encode() if spec_json is None else spec_json
        return cls(instance_id, body, spec.role.value, spec.url, kv, ttl_s, owner, max_owned)


@dataclass(frozen=True, slots=True)
class StoreStats:
    by_state: dict[str, int]
    scanned: int
    done_latencies_s: list[float]
    instances_by_role: dict[str, int]


@dataclass(frozen=True, slots=True)
class OpenTransfers:
    """Bindings not in a terminal state yet, among the newest ``scan_limit``."""

    by_state: dict[str, int]
    oldest_created_at: float | None  # None: none open


def open_transfers_of(pairs: Iterable[tuple[str, float]]) -> OpenTransfers:
    """From (state, created_at) of each scanned binding."""
    by_state: dict[str, int] = {}
    oldest: float | None = None
    for state, created in pairs:
        if BindingState(state).terminal:
            continue
        by_state[state] = by_state.get(state, 0) + 1
        oldest = created if oldest is None else min(oldest, created)
    return OpenTransfers(by_state, oldest)


def event_json(state: BindingState, actor: str, at: float, detail_json: bytes | None) -> bytes:
    body = f'{{"state":"{state.value}","actor":{json.dumps(actor)},"at":{at!r},"detail":'
    return body.encode() + (detail_json or b"null") + b"}"


def mark_json(kind: MarkKind, actor: str, at: float, detail_json: bytes | None) -> bytes:
    body = f'{{"mark":"{kind.value}","actor":{json.dumps(actor)},"at":{at!r},"detail":'
    return body.encode() + (detail_json or b"null") + b"}"


def check_transition(current: BindingState, new: BindingState) -> str:
    """Return ``"apply"``, ``"duplicate"`` or ``"conflict"`` for a state change.

    States only move forward (bound → prefill_started → pushing → done|failed|aborted, steps may
    be skipped); ``pushing`` may repeat to report progress; re-sending the current state is an
    idempotent duplicate; nothing leaves a terminal state.
    """
    if current.terminal:
        return "duplicate" if new is current else "conflict"
    if new is current:
        return "apply" if new is BindingState.PUSHING else "duplicate"
    return "apply" if new.rank > current.rank else "conflict"


class Store(abc.ABC):
    """Persistence for bindings and instances. Implementations raise ``StoreUnavailable``
    when their backend cannot be reached, ``Conflict``/``Unprocessable``/``NotFound`` for
    requests that are wrong whatever the backend's health."""

    description: str = "store"

    async def start(self) -> None:  # noqa: B027 - optional hook
        """Open connections and background tasks."""

    async def close(self) -> None:  # noqa: B027 - optional hook
        """Release everything ``start`` opened."""

    @abc.abstractmethod
    async def ping(self) -> None: ...

    # bindings
    @abc.abstractmethod
    async def put_binding(
        self, put: BindingPut, now: float
    ) -> tuple[PutOutcome, StoredBinding]: ...

    @abc.abstractmethod
    async def get_binding(self, transfer_id: str) -> StoredBinding | None: ...

    @abc.abstractmethod
    async def delete_binding(self, transfer_id: str) -> bool: ...

    @abc.abstractmethod
    async def list_bindings(
        self, *, state: BindingState | None, instance_id: str | None, limit: int
    ) -> list[StoredBinding]: ...

    @abc.abstractmethod
    async def add_event(self, put: EventPut, now: float) -> StoredBinding:
        """Apply a state change (``check_transition``) that is the actor's to make
        (``owner_problem``); ``NotFound``, ``Conflict`` or ``Forbidden`` otherwise."""

    @abc.abstractmethod
    async def add_mark(self, transfer_id: str, kind: MarkKind, mark_json: bytes) -> bool:
        """Record a mark; True when recorded, False when one of that kind was already there
        (kept once per kind: the first wins); ``NotFound`` without the binding. A mark never
        changes the state, the update time or the expiry, and is accepted in any state,
        terminal ones included. Nothing is read back: marks are fire-and-forget."""

    # instances
    @abc.abstractmethod
    async def put_instance(self, put: InstancePut, now: float) -> tuple[PutOutcome, StoredInstance]:
        """Register or heartbeat; ``Conflict`` when another live instance has the URL or the KV
        endpoint, ``Forbidden`` when the owner already holds ``max_owned`` other instances."""

    @abc.abstractmethod
    async def get_instance(self, instance_id: str) -> StoredInstance | None: ...

    @abc.abstractmethod
    async def list_instances(self, role: str | None) -> list[StoredInstance]: ...

    @abc.abstractmethod
    async def delete_instance(self, instance_id: str) -> bool: ...

    @abc.abstractmethod
    async def set_draining(self, instance_id: str, draining: bool) -> StoredInstance | None:
        """Mark a live instance drained (or not); ``None`` when it is not registered. The flag
        survives heartbeats and goes with the registration (deleted or lapsed)."""

    @abc.abstractmethod
    async def stats(self, scan_limit: int) -> StoreStats: ...

    @abc.abstractmethod
    async def open_transfers(self, scan_limit: int) -> OpenTransfers:
        """The newest ``scan_limit`` bindings that are not done, failed or aborted."""

    # change notification (long-poll)
    @abc.abstractmethod
    def changes(self, transfer_id: str) -> ChangeSubscription: ...

    # creations (binding feeds)
    @abc.abstractmethod
    def watch_created(self, listener: CreatedListener) -> Callable[[], None]:
        """Call ``listener(record)`` for each binding created from now on — by this process or
        by any replica sharing the store — once the store's notifications flow (see
        ``notifications_live``); ``listener(None)`` when some may have been missed. Returns
        the call that stops it."""

    @abc.abstractmethod
    def load_board(self) -> LoadBoard:
        """The proxy replicas' shared load (``metaserver.loadboard``)."""

    @abc.abstractmethod
    def kv_index(self) -> KVIndex:
        """The KV-event index kept beside this store (``metaserver.kvindex``)."""

    async def notifications_live(self) -> None:  # noqa: B027 - always live in memory
        """Return once change notifications flow (Redis: its subscription is confirmed)."""


class ChangeSubscription(abc.ABC):
    """Wakes a waiter when a binding may have changed. Use as an async context manager, then
    ``await sub.wait(timeout_s)`` (returns False on timeout). Wakeups may be spurious: always
    re-read the record."""

    async def __aenter__(self) -> ChangeSubscription:
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.close()

    @abc.abstractmethod
    async def wait(self, timeout_s: float) -> bool: ...

    @abc.abstractmethod
    def close(self) -> None: ...


class LocalWaiters:
    """transfer_id → events of the waiters in this process; fed by the store's notifications."""

    def __init__(self) -> None:
        self._waiters: dict[str, set[asyncio.Event]] = {}
        self._created: list[CreatedListener] = []

    def subscribe(self, transfer_id: str) -> _LocalSubscription:
        return _LocalSubscription(self, transfer_id)

    def notify(self, transfer_id: str) -> None:
        for event in self._waiters.get(transfer_id, ()):
            event.set()

    def notify_all(self) -> None:
        for events in self._waiters.values():
            for event in events:
                event.set()

    def created(self, record: StoredBinding) -> None:
        """A new binding: its waiters wake, and the creation listeners get the record."""
        self.notify(record.transfer_id)
        for listener in self._created:
            listener(record)

    def lost(self) -> None:
        """Notifications may have been missed: creation listeners hear ``None``."""
        for listener in list(self._created):
            listener(None)

    def watch_created(self, listener: CreatedListener) -> Callable[[], None]:
        self._created.append(listener)
        return lambda: self._created.remove(listener) if listener in self._created else None

    def __len__(self) -> int:
        return sum(len(v) for v in self._waiters.values())

    def _add(self, transfer_id: str, event: asyncio.Event) -> None:
        self._waiters.setdefault(transfer_id, set()).add(event)

    def _remove(self, transfer_id: str, event: asyncio.Event) -> None:
        events = self._waiters.get(transfer_id)
        if events is not None:
            events.discard(event)
            if not events:
                del self._waiters[transfer_id]


class _LocalSubscription(ChangeSubscription):
    def __init__(self, registry: LocalWaiters, transfer_id: str) -> None:
        self._registry = registry
        self._transfer_id = transfer_id
        self._event = asyncio.Event()
        registry._add(transfer_id, self._event)

    async def wait(self, timeout_s: float) -> bool:
        try:
            await asyncio.wait_for(self._event.wait(), timeout_s)
        except TimeoutError:
            return False
        self._event.clear()
        return True

    def close(self) -> None:
        self._registry._remove(self._transfer_id, self._event)


def decode_instance_problem(
    put: BindingPut, found: tuple[str, tuple[str, int] | None] | None
) -> str | None:
    """The one rule both stores enforce: a binding may only point at a live, registered decode
    instance, at the KV endpoint that instance registered. This is what stops KV from being
    pushed to an address chosen by whoever writes the binding."""
    if found is None:
        return f"decode instance {put.decode_instance_id!r} is not registered (or its TTL lapsed)"
    role, kv = found
    if role == "prefill":
        return f"instance {put.decode_instance_id!r} is registered as prefill-only"
    if kv is None:
        return f"instance {put.decode_instance_id!r} registered no kv_endpoint"
    if kv != (put.kv_host, put.kv_port):
        return (
            f"kv_endpoint {put.kv_host}:{put.kv_port} does not match the one instance "
            f"{put.decode_instance_id!r} registered ({kv[0]}:{kv[1]})"
        )
    return None
