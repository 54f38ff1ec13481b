"""Fire-and-forget binding events from the proxy (``aborted``, ``failed``): never on the
response's critical path, bounded so a slow metaserver cannot pile up tasks.

An outcome can be known before D has written the binding it belongs to (the concurrent flow
sends P at once, and P may answer ``push: none`` before D's write lands): an event answered
404 is posted again a few times over ``NOT_YET_S`` before it is given up."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import Protocol

from pdwire.client import MetaserverClientError, NotFoundError
from pdwire.models import BindingState, EventDetail

log = logging.getLogger("pdgate.proxy.events")
ACTOR = "proxy"
NOT_YET_S = (0.1, 0.3, 1.0, 2.0)  # waits before re-posting an event whose binding is missing


class EventClient(Protocol):
    """Where events go: ``pdwire.client.AsyncMetaserverClient`` (``proxy.mock`` has a double)."""

    async def post_event(
        self, transfer_id: str, state: BindingState, actor: str, detail: EventDetail | None = None
    ) -> object: ...


class EventSink:
    def __init__(
        self,
        client: EventClient,
        *,
        max_pending: int = 1024,
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
    ) -> None:
        self._client = client
        self._sleep = sleep
        self._max = max_pending
        self._pending: set[asyncio.Task[None]] = set()
        self.dropped = 0
        self.sent = 0

    def post(self, transfer_id: str, state: BindingState, error: str | None = None) -> None:
        if len(self._pending) >= self._max:
            self.dropped += 1
            return
        task = asyncio.get_running_loop().create_task(self._send(transfer_id, state, error))
        self._pending.add(task)
        task.add_done_callback(self._pending.discard)

    async def _send(self, transfer_id: str, state: BindingState, error: str | None) -> None:
        detail = EventDetail(error=error[:4000]) if error else None
        for wait in (*NOT_YET_S, None):
            try:
                await self._client.post_event(transfer_id, state, ACTOR, detail)
                self.sent += 1
                return
            except MetaserverClientError as exc:
                if wait is None or not isinstance(exc, NotFoundError):
                    log.debug(
                        "binding %s: %s event not recorded: %s", transfer_id, state.value, exc
                    )
                    return
            await self._sleep(wait)

    async def drain(self, timeout_s: float = 5.0) -> None:
        if self._pending:
            await asyncio.wait(set(self._pending), timeout=timeout_s)
