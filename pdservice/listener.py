"""Guards for the proxy's and the metaserver's listeners: a mixin for uvicorn's httptools
protocol (``class P(ListenerGuards, HttpToolsProtocol)``; this package does not import uvicorn,
each part puts the two together).

* **Receipt deadline**: from a request's first byte its head must be complete within the app's
  ``receipt_timeout_s`` (with ``receipt_whole_request``: its whole body too), else the
  connection is closed: a client sending a request byte by byte would hold a connection for
  good otherwise. A new connection that sends nothing is closed after the keep-alive timeout,
  as an idle one is. A request costs two attribute writes; one sweep per server (a timer while
  it has connections) closes the late ones.
* **Write timeout**: a client that reads nothing of its answer while the connection's write
  buffer is full (the transport paused writing) for the app's ``write_timeout_s`` has its
  connection aborted, so a stalled reader cannot hold its request (and a decode instance's
  sequence behind it) for good. No cost while the client keeps up: a timer runs only while
  writing is paused.
* **Connections per client**: with the app's ``max_client_connections`` > 0, a peer address
  that already holds that many connections has its next one closed at once (logged once per
  minute per address). Behind a load balancer every client has the balancer's address: leave
  it off there, or set it above what the balancer opens.

The settings are read from the app uvicorn serves (through the wrappers it puts around it).
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

log = logging.getLogger("pdgate.http")
RECEIPT_TIMEOUT_S = 30.0  # when the app does not name one
_TOLD_EVERY_S = 60.0


def app_setting(app: Any, name: str, default: Any) -> Any:
    """``name`` of the app under whatever uvicorn wrapped it in (``default``: not set)."""
    for _ in range(8):
        if app is None or hasattr(app, name):
            break
        app = getattr(app, "app", None)
    return getattr(app, name, default)


class ListenerGuards:
    """The guards above; the attributes it reads are uvicorn's protocol's."""

    app: Any
    loop: asyncio.AbstractEventLoop
    transport: asyncio.Transport
    client: tuple[str, int] | None
    server_state: Any
    timeout_keep_alive: int

    _due: float | None = None  # when the pending head (or first byte, or body) is late
    _awaiting = ""
    _receipt_s = RECEIPT_TIMEOUT_S
    _whole = False
    _peer: str | None = None
    _write_s = 0.0
    _stalled: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)  # type: ignore[misc]
        self._receipt_s = float(app_setting(self.app, "receipt_timeout_s", RECEIPT_TIMEOUT_S))
        self._whole = bool(app_setting(self.app, "receipt_whole_request", False))
        self._write_s = float(app_setting(self.app, "write_timeout_s", 0.0))
        guard = _Guard.of(self)
        cap = int(app_setting(self.app, "max_client_connections", 0))
        if cap > 0 and self.client is not None:
            peer = str(self.client[0])
            if not guard.admit(peer, cap):
                self.transport.close()
                return
            self._peer = peer
        self._due = self.loop.time() + self.timeout_keep_alive
        self._awaiting = "sent nothing"
        guard.ensure()

    def on_message_begin(self) -> None:
        super().on_message_begin()  # type: ignore[misc]
        self._due = self.loop.time() + self._receipt_s
        self._awaiting = "no complete request head"

    def on_headers_complete(self) -> None:
        if self._whole:
            self._awaiting = "no complete request body"
        else:
            self._due = None
        super().on_headers_complete()  # type: ignore[misc]

    def on_message_complete(self) -> None:
        self._due = None
        super().on_message_complete()  # type: ignore[misc]

    def close_if_late(self, now: float) -> None:
        if self._due is not None and now > self._due:
            self._due = None
            log.info("closing the connection of %s: %s in time", self.client, self._awaiting)
            self.transport.close()

    def sweep_period(self) -> float:
        return max(0.05, min(self._receipt_s, self.timeout_keep_alive, 4.0) / 4)

    def pause_writing(self) -> None:
        super().pause_writing()  # type: ignore[misc]
        if self._write_s > 0 and self._stalled is None:
            self._stalled = self.loop.call_later(self._write_s, self._reader_stalled)

    def resume_writing(self) -> None:
        super().resume_writing()  # type: ignore[misc]
        if self._stalled is not None:
            self._stalled.cancel()
            self._stalled = None

    def _reader_stalled(self) -> None:
        self._stalled = None
        log.info(
            "aborting the connection of %s: it read nothing of its answer for %.0fs",
            self.client, self._write_s,
        )  # fmt: skip
        self.transport.abort()  # close() would first wait for the buffer to drain

    def connection_lost(self, exc: Exception | None) -> None:
        self._due = None
        if self._stalled is not None:
            self._stalled.cancel()
            self._stalled = None
        if self._peer is not None:
            _Guard.of(self).leave(self._peer)
            self._peer = None
        super().connection_lost(exc)  # type: ignore[misc]


class _Guard:
    """One per server (kept on uvicorn's ``ServerState``): the connections per peer, and a
    sweep that every ``sweep_period`` closes the connections whose request is late; the sweep
    stops while the server has no connection."""

    def __init__(self, state: Any, loop: asyncio.AbstractEventLoop, period: float) -> None:
        self._state = state
        self._loop = loop
        self._period = period
        self._timer: asyncio.TimerHandle | None = None
        self._per_peer: dict[str, int] = {}
        self._told: dict[str, float] = {}

    @classmethod
    def of(cls, proto: ListenerGuards) -> _Guard:
        state = proto.server_state
        guard: _Guard | None = getattr(state, "pdgate_guard", None)
        if guard is None:
            guard = cls(state, proto.loop, proto.sweep_period())
            setattr(state, "pdgate_guard", guard)  # noqa: B010 (uvicorn's ServerState has no slot)
        return guard

    def admit(self, peer: str, cap: int) -> bool:
        held = self._per_peer.get(peer, 0)
        if held >= cap:
            now = self._loop.time()
            if now - self._told.get(peer, -_TOLD_EVERY_S) >= _TOLD_EVERY_S:
                self._told[peer] = now
                log.warning("%s holds %d connections (the cap): closing its new ones", peer, cap)
            return False
        self._per_peer[peer] = held + 1
        return True

    def leave(self, peer: str) -> None:
        held = self._per_peer.get(peer, 0) - 1
        if held > 0:
            self._per_peer[peer] = held
        else:
            self._per_peer.pop(peer, None)

    def ensure(self) -> None:
        if self._timer is None:
            self._timer = self._loop.call_later(self._period, self._run)

    def _run(self) -> None:
        self._timer = None
        now = self._loop.time()
        for proto in list(self._state.connections):
            if isinstance(proto, ListenerGuards):
                proto.close_if_late(now)
        if self._state.connections:
            self.ensure()
