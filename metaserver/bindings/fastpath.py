"""ASGI fast path for the calls on the P/D data path.

``PUT /v1/bindings/{id}``, ``GET /v1/bindings/{id}`` (plain reads and long-polls),
``POST /v1/bindings/{id}/events``, ``POST /v1/bindings/{id}/marks`` and ``POST /v1/batch`` (several
of those writes at once) are served here, in
front of FastAPI, calling the very same ``bindings.service`` functions as the documented
routes — only the framework's per-request machinery (routing table, dependency solving,
middleware stack) is skipped. Everything else, including any unusual query string, falls
through to FastAPI.
"""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Awaitable, Callable

from metaserver.access.principal import Principal
from metaserver.ascend import compat as ascend
from metaserver.bindings import batch, service
from metaserver.context import Context
from metaserver.errors import MetaserverError, PayloadTooLarge
from metaserver.problems import render_problem
from metaserver.validation import BodyInvalid
from pdservice.asgi import (
    ASGIApp,
    BodyTooLarge,
    ClientDisconnected,
    Receive,
    Scope,
    Send,
    read_body,
)
from pdwire.ascend import COMPAT_PATH
from pdwire.ids import TRANSFER_ID_PATTERN
from pdwire.models import BATCH_PATH, BindingState

log = logging.getLogger("pdgate.metaserver")
_PREFIX = "/v1/bindings/"
_ID = re.compile(TRANSFER_ID_PATTERN)
_ROUTE = "/v1/bindings/{transfer_id}"
_EVENTS_ROUTE = "/v1/bindings/{transfer_id}/events"
_ASCEND = "ascend"  # marks the vllm-ascend compat call (its capability comes in the query)
_BATCH = "batch"  # marks POST /v1/batch (no transfer id of its own)
_MARKS_ROUTE = "/v1/bindings/{transfer_id}/marks"
_JSON = [(b"content-type", b"application/json")]
_TIMED_OUT = [*_JSON, (b"x-pdgate-wait", b"timeout")]

Handler = Callable[[Context, Principal, str, bytes], Awaitable[service.Reply]]


async def _get(c: Context, who: Principal, transfer_id: str, body: bytes) -> service.Reply:
    return await service.get_binding(c, transfer_id)


async def _batch(c: Context, who: Principal, transfer_id: str, body: bytes) -> service.Reply:
    return await batch.run(c, who, body)


def _long_poll(query: bytes) -> Handler | None:
    """A handler for ``?wait=S[&state=X]``, or None when the query is anything else (FastAPI
    then answers, with its documented validation errors)."""
    wait: float | None = None
    state: BindingState | None = None
    for part in query.split(b"&"):
        key, _, value = part.partition(b"=")
        try:
            if key == b"wait" and wait is None:
                wait = float(value)
                if not 0 < wait <= 3600 or wait != wait:
                    return None
            elif key == b"state" and state is None:
                state = BindingState(value.decode())
            else:
                return None
        except ValueError:
            return None
    if wait is None:
        return None

    async def handler(c: Context, who: Principal, transfer_id: str, body: bytes) -> service.Reply:
        return await service.get_binding(c, transfer_id, wait, state)

    return handler


class FastPath:
    def __init__(self, app: ASGIApp, ctx: Context) -> None:
        self.app = app
        self.ctx = ctx
        self.max_body = ctx.settings.max_body_bytes
        metrics = ctx.metrics
        self._count = metrics.requests
        self._latency = {
            (m, r): metrics.latency.labels(m, r)
            for m, r in (
                ("PUT", _ROUTE),
                ("GET", _ROUTE),
                ("POST", _EVENTS_ROUTE),
                ("POST", COMPAT_PATH),
                ("POST", _MARKS_ROUTE),
                ("POST", BATCH_PATH),
            )  # fmt: skip
        }

    async def _body(self, receive: Receive, declared: int) -> bytes:
        try:
            return await read_body(receive, self.max_body, declared)
        except BodyTooLarge as exc:
            raise PayloadTooLarge(str(exc)) from None

    def _match(self, scope: Scope) -> tuple[str, Handler | None, str] | None:
        path: str = scope["path"]
        if path == COMPAT_PATH and scope["method"] == "POST":
            return _ASCEND, None, COMPAT_PATH  # ascend.post_binding, with its own grant
        if path == BATCH_PATH and scope["method"] == "POST":
            return _BATCH, _batch, BATCH_PATH
        if not path.startswith(_PREFIX):
            return None
        rest = path[len(_PREFIX) :]
        method = scope["method"]
        handler: Handler | None
        if method == "POST" and rest.endswith("/events"):
            tid, route, handler = rest[:-7], _EVENTS_ROUTE, service.post_event
        elif method == "POST" and rest.endswith("/marks"):
            tid, route, handler = rest[:-6], _MARKS_ROUTE, service.post_mark
        elif method == "PUT":
            tid, route, handler = rest, _ROUTE, service.put_binding
        elif method == "GET":
            query: bytes = scope["query_string"]
            tid, route, handler = rest, _ROUTE, _long_poll(query) if query else _get
        else:
            return None
        if handler is None or not _ID.fullmatch(tid):
            return None  # FastAPI answers the validation error in its documented shape
        return tid, handler, route

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        match = self._match(scope) if scope["type"] == "http" else None
        if match is None:
            await self.app(scope, receive, send)
            return
        started = time.perf_counter()
        transfer_id, handler, route = match
        method: str = scope["method"]
        headers: list[tuple[bytes, bytes]] = _JSON
        try:
            auth = None
            declared = -1
            for name, value in scope["headers"]:
                if name == b"authorization":
                    auth = value
                elif name == b"content-length":
                    declared = int(value) if value.isdigit() else -1
            if handler is None:  # the vllm-ascend compat call
                grant = await ascend.authorize(self.ctx, auth, scope["query_string"])
                body = await self._body(receive, declared)
                reply = await ascend.post_binding(self.ctx, grant, body)
            else:
                who = await self.ctx.authorize(auth, write=method != "GET")
                body = b"" if method == "GET" else await self._body(receive, declared)
                reply = await handler(self.ctx, who, transfer_id, body)
            status, payload = reply.status, reply.body
            if reply.wait_timed_out:
                headers = _TIMED_OUT
        except ClientDisconnected:
            return  # the client left before its body was complete: nothing done, nobody to tell
        except (MetaserverError, BodyInvalid) as exc:
            status, payload, extra = render_problem(exc, self.ctx.metrics)
            headers = _JSON + extra
        except Exception:
            log.exception("%s %s failed", method, scope["path"])
            status, payload = 500, b'{"detail":"internal error"}'
        if status == 204:  # no body, so no content headers (RFC 9110 §8.6)
            headers = []
        else:
            headers = [*headers, (b"content-length", str(len(payload)).encode())]
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": payload})
        self._count.labels(method, route, str(status)).inc()
        self._latency[(method, route)].observe(time.perf_counter() - started)
