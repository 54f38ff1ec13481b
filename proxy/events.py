"""Fire-and-forget binding events (``aborted``, ``failed``) and marks (``first_token``,
``end``) from the proxy: never on the response's critical path, bounded so a slow metaserver
cannot pile up tasks.

An outcome can be known before D has written the binding it belongs to (the concurrent flow
sends P at once, and P may answer ``push: none`` before D's write lands): an event answered
404 is posted again a few times over ``NOT_YET_S`` before it is given up."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import Protocol

from pdwire.client import MetaserverClientError, NotFoundError
from pdwire.models import BindingState, EventDetail, MarkDetail, MarkKind

log = logging.getLogger("pdgate.proxy.events")
ACTOR = "proxy"
NOT_YET_S = (0.1, 0.3, 1.0, 2.0)  # waits before re-posting an event whose binding is missing


class EventClient(Protocol):
    """Where events go: ``pdwire.client.AsyncMetaserverClient`` (``proxy.mock`` has a double)."""

    async def post_event(
        self, transfer_id: str, state: BindingState, actor: str, detail: EventDetail | None = None
    ) -> object: ...

    async def post_mark(
        self, transfer_id: str, mark: MarkKind, actor: str, detail: MarkDetail | None = None
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
        detail = EventDetail(error=error[:4000]) if error else None
        self._spawn(transfer_id, state.value, self._client.post_event, state, ACTOR, detail)

    def mark(
        self,
        transfer_id: str,
        kind: MarkKind,
        since_request_s: float | None,
        outcome: str | None = None,
        kv_held: dict[str, int] | None = None,
        chunks: int | None = None,
    ) -> None:
        """Report a moment of the transfer (first token, end of the answer, a first-token
        mismatch) to its binding."""
        since = None if since_request_s is None else max(0.0, since_request_s)
        detail = MarkDetail(since_request_s=since, outcome=outcome, kv_held=kv_held, chunks=chunks)
        self._spawn(transfer_id, kind.value, self._client.post_mark, kind, ACTOR, detail)

    def _spawn(
        self, transfer_id: str, what: str, call: Callable[..., Awaitable[object]], *args: object
    ) -> None:
        if len(self._pending) >= self._max:
            self.dropped += 1
            return
        coro = self._send(transfer_id, what, call, args)
        task = asyncio.get_running_loop().create_task(coro)
        self._pending.add(task)
        task.add_done_callback(self._pending.discard)

    async def _send(
        self,
        transfer_id: str,
        what: str,
        call: Callable[..., Awaitable[object]],
        args: tuple[object, ...],
    ) -> None:
        for wait in (*NOT_YET_S, None):
            try:
                await call(transfer_id, *args)
                self.sent += 1
                return
            except MetaserverClientError as exc:
                if wait is None or not isinstance(exc, NotFoundError):
                    log.debug("binding %s: %s not recorded: %s", transfer_id, what, exc)
                    return
            await self._sleep(wait)

    async def drain(self, timeout_s: float = 5.0) -> None:
        if self._pending:
            await asyncio.wait(set(self._pending), timeout=timeout_s)
