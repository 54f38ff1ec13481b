"""Fire-and-forget binding marks from the proxy (``first_token``, ``end``, ``abandoned``…): never
on the response's critical path, bounded so a slow metaserver cannot pile up tasks.

The proxy reports what it saw; it never moves a transfer's state (the metaserver refuses it
binding events): when it gives up on a transfer's KV it marks the binding ``abandoned``, and the
engines' own events end it (D posts ``aborted`` when its waiting request goes away).

An outcome can be known before D has written the binding it belongs to (the concurrent flow
sends P at once, and P may answer ``push: none`` before D's write lands): a mark answered 404 is
posted again a few times over ``NOT_YET_S`` before it is given up."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import Protocol

from pdwire.client import MetaserverClientError, NotFoundError
from pdwire.models import BindingState, MarkDetail, MarkKind

log = logging.getLogger("pdgate.proxy.events")
ACTOR = "proxy"
NOT_YET_S = (0.1, 0.3, 1.0, 2.0)  # waits before re-posting an event whose binding is missing


class EventClient(Protocol):
    """Where marks go: ``pdwire.client.AsyncMetaserverClient`` (``tests.proxy.mock`` has a
    double)."""

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

    def abandon(self, transfer_id: str, outcome: BindingState, why: str | None = None) -> None:
        """The proxy gave up on this transfer's KV: ``failed`` (P failed, pushed nothing, the
        binding could not be used) or ``aborted`` (anything else), and why."""
        detail = MarkDetail(outcome=outcome.value, message=why[:1000] if why else None)
        kind = MarkKind.ABANDONED
        self._spawn(transfer_id, kind.value, self._client.post_mark, kind, ACTOR, detail)

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


class NoEvents:
    """The sink of a proxy without a metaserver: it has no binding to mark."""

    __slots__ = ()

    def abandon(self, transfer_id: str, outcome: BindingState, why: str | None = None) -> None:
        pass

    def mark(
        self,
        transfer_id: str,
        kind: MarkKind,
        since_request_s: float | None,
        outcome: str | None = None,
        kv_held: dict[str, int] | None = None,
        chunks: int | None = None,
    ) -> None:
        pass

    async def drain(self, timeout_s: float = 5.0) -> None:
        pass


NO_EVENTS = NoEvents()
