"""uvicorn's httptools protocol with one write per response on the hot endpoints.

uvicorn writes a response's status line and headers (``http.response.start``) and then each
body part with separate ``transport.write`` calls: two socket writes for every non-streamed
answer. On ``/v1/completions`` and ``/v1/chat/completions`` the proxy's handler always sends
the first body part right after the start, so the head is held back and written together with
it (one syscall less per response; measured in ``docs/benchmarks.md``). The hot
requests' scope also gets an ``ON_DISCONNECT`` slot, called from ``connection_lost``, so the
handler notices a client that went away without a watcher task per request. Other paths are
left as uvicorn serves them, with ``pdservice.listener``'s receipt deadlines and per-client cap.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any, cast

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from pdservice.listener import ListenerGuards
from proxy.handler import HOT_PATHS
from proxy.watcher import ON_DISCONNECT


class _HeldHead:
    """Wraps the transport for one request: the first write waits for the second one."""

    __slots__ = ("_head", "_state", "_transport")

    def __init__(self, transport: asyncio.Transport) -> None:
        self._transport = transport
        self._head = b""
        self._state = 0  # 0: nothing written, 1: head held, 2: passing through

    def write(self, data: bytes) -> None:
        state = self._state
        if state == 2:
            self._transport.write(data)
        elif state == 1:
            self._state = 2
            self._transport.write(self._head + data)
            self._head = b""
        else:
            self._state = 1
            self._head = data

    def close(self) -> None:
        if self._state == 1:
            self._state = 2
            self._transport.write(self._head)
        self._transport.close()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._transport, name)


class CoalescingHttpToolsProtocol(ListenerGuards, HttpToolsProtocol):
    """The hot paths' head held for their first body part, and their client's disconnect
    reported to the handler; receipt deadlines (the head only: the handler bounds the body)
    and the per-client cap from ``pdservice.listener``."""

    def on_headers_complete(self) -> None:
        before = self.cycle
        super().on_headers_complete()
        cycle = self.cycle
        if (
            cycle is not None
            and cycle is not before
            and not self.expect_100_continue  # "100 Continue" must not wait for the answer
            and self.scope["path"] in HOT_PATHS
        ):
            cycle.transport = _HeldHead(self.transport)  # type: ignore[assignment]
            cast(dict[str, Any], self.scope)[ON_DISCONNECT] = None  # the handler's watcher

    def connection_lost(self, exc: Exception | None) -> None:
        cycle = self.cycle
        hook: Callable[[], None] | None = None
        if cycle is not None and not cycle.response_complete:
            scope = cast(dict[str, Any], cycle.scope)
            hook = scope.get(ON_DISCONNECT)
            scope[ON_DISCONNECT] = None
        super().connection_lost(exc)
        if hook is not None:
            hook()
