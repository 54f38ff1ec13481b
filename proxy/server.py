"""uvicorn's httptools protocol with one write per response on the hot endpoints.

uvicorn writes a response's status line and headers (``http.response.start``) and then each
body part with separate ``transport.write`` calls: two socket writes for every non-streamed
answer. On ``/v1/completions`` and ``/v1/chat/completions`` the proxy's handler always sends
the first body part right after the start, so the head is held back and written together with
it (one syscall less per response; measured in ``docs/benchmarks.md``). The hot
requests' scope also gets an ``ON_DISCONNECT`` slot, called from ``connection_lost``, so the
handler notices a client that went away without a watcher task per request. Other paths are
left exactly as uvicorn serves them.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any, cast

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from proxy.handler import HOT_PATHS
from proxy.watcher import ON_DISCONNECT

log = logging.getLogger("pdgate.proxy")
RECEIPT_TIMEOUT_S = 30.0  # when the app does not name one (ProxyApp.receipt_timeout_s)


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


def _receipt_timeout_of(app: Any) -> float:
    """``receipt_timeout_s`` of the proxy's app, under whatever uvicorn wrapped it in."""
    for _ in range(8):
        if app is None or hasattr(app, "receipt_timeout_s"):
            break
        app = getattr(app, "app", None)
    return float(getattr(app, "receipt_timeout_s", RECEIPT_TIMEOUT_S))


class CoalescingHttpToolsProtocol(HttpToolsProtocol):
    """Also receipt deadlines: from a request's first byte its head must be complete within
    the app's ``receipt_timeout_s``, else the connection is closed (a client sending a head
    byte by byte holds a connection forever otherwise); a new connection that sends nothing is
    closed after the keep-alive timeout, as an idle one is. A request costs two attribute
    writes; one sweep per server (a timer while it has connections) closes the late ones."""

    _due: float | None = None  # when the pending head (or first byte) is late
    _awaiting = ""
    _receipt_s = RECEIPT_TIMEOUT_S

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._receipt_s = _receipt_timeout_of(self.app)
        self._due = self.loop.time() + self.timeout_keep_alive
        self._awaiting = "sent nothing"
        _Sweep.of(self).ensure()

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._due = self.loop.time() + self._receipt_s
        self._awaiting = "no complete request head"

    def close_if_late(self, now: float) -> None:
        if self._due is not None and now > self._due:
            self._due = None
            log.info("closing the connection of %s: %s in time", self.client, self._awaiting)
            self.transport.close()

    def sweep_period(self) -> float:
        return max(0.05, min(self._receipt_s, self.timeout_keep_alive, 4.0) / 4)

    def on_headers_complete(self) -> None:
        self._due = None
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
        self._due = None
        cycle = self.cycle
        hook: Callable[[], None] | None = None
        if cycle is not None and not cycle.response_complete:
            scope = cast(dict[str, Any], cycle.scope)
            hook = scope.get(ON_DISCONNECT)
            scope[ON_DISCONNECT] = None
        super().connection_lost(exc)
        if hook is not None:
            hook()


class _Sweep:
    """One per server (kept on uvicorn's ``ServerState``): every ``sweep_period`` it closes the
    connections whose head is late, and it stops while the server has no connection."""

    def __init__(self, state: Any, loop: asyncio.AbstractEventLoop, period: float) -> None:
        self._state = state
        self._loop = loop
        self._period = period
        self._timer: asyncio.TimerHandle | None = None

    @classmethod
    def of(cls, proto: CoalescingHttpToolsProtocol) -> _Sweep:
        state = proto.server_state
        sweep: _Sweep | None = getattr(state, "pdgate_sweep", None)
        if sweep is None:
            sweep = cls(state, proto.loop, proto.sweep_period())
            setattr(state, "pdgate_sweep", sweep)  # noqa: B010 (uvicorn's ServerState has no slot)
        return sweep

    def ensure(self) -> None:
        if self._timer is None:
            self._timer = self._loop.call_later(self._period, self._run)

    def _run(self) -> None:
        self._timer = None
        now = self._loop.time()
        for proto in list(self._state.connections):
            if isinstance(proto, CoalescingHttpToolsProtocol):
                proto.close_if_late(now)
        if self._state.connections:
            self.ensure()
