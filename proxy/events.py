"""Fire-and-forget binding events from the proxy (``aborted``, ``failed``): never on the
response's critical path, bounded so a slow metaserver cannot pile up tasks."""

from __future__ import annotations

import asyncio
import logging

from metaserver.client import AsyncMetaserverClient, MetaserverClientError
from metaserver.models import BindingState, EventDetail

log = logging.getLogger("pdgate.proxy.events")
ACTOR = "proxy"


class EventSink:
    def __init__(self, client: AsyncMetaserverClient, *, max_pending: int = 1024) -> None:
        self._client = client
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
        try:
            await self._client.post_event(transfer_id, state, ACTOR, detail)
            self.sent += 1
        except MetaserverClientError as exc:
            log.debug("binding %s: %s event not recorded: %s", transfer_id, state.value, exc)

    async def drain(self, timeout_s: float = 5.0) -> None:
        if self._pending:
            await asyncio.wait(set(self._pending), timeout=timeout_s)
