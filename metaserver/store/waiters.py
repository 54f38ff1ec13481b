"""Long-poll waiters and creation listeners of this process, woken by the store's own
notifications (memory: each write; Redis: its pub/sub listener)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from metaserver.store.base import ChangeSubscription, CreatedListener
from metaserver.store.records import StoredBinding


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
