"""The ``Store`` interface: bindings and the instance registry, everything the HTTP layer needs
from persistence (the records are ``store.records``; the rules every store enforces,
``store.rules``). The KV index and the load board are not the store's: the backend
(``metaserver.backend``) builds them beside it."""

from __future__ import annotations

import abc
from collections.abc import Callable

from metaserver.store.records import (
    BindingPut,
    EventPut,
    InstancePut,
    OpenTransfers,
    PutOutcome,
    StoredBinding,
    StoredInstance,
    StoreStats,
)
from pdwire.models import BindingState, MarkKind

# Told of each binding created from now on, on any replica sharing the store; ``None`` when
# notifications may have been missed (the store's subscription was interrupted).
CreatedListener = Callable[["StoredBinding | None"], None]


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
