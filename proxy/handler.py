"""The hot path: ``POST /v1/completions`` and ``/v1/chat/completions`` as a lean ASGI handler.

Raw body, one JSON parse, SSE bytes passed through. A watcher on ``receive()`` notices a client
that goes away and cancels the request at once: both legs are dropped (closing a connection
aborts a vLLM request), load is released in ``finally``, the binding is marked ``aborted``.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import MutableMapping
from typing import Any

from metaserver.models import BindingState
from proxy.config import Flow
from proxy.errors import BadRequest, ProxyError, Unauthorized, sse_error_event
from proxy.flows import Upstream
from proxy.ids import VALID_ID, IdMaker
from proxy.instances import Instance
from proxy.rewrite import ClientRequest
from proxy.runtime import Runtime
from proxy.sse import fix_body, relay_stream

log = logging.getLogger("pdgate.proxy")
Scope = MutableMapping[str, Any]
HOT_PATHS = frozenset({"/v1/completions", "/v1/chat/completions"})
_JSON = b"application/json"


class _Disconnected(Exception):
    pass


class CompletionsHandler:
    def __init__(self, rt: Runtime) -> None:
        self.rt = rt
        self._ids = IdMaker("req")
        self._flow_default = rt.settings.flow
        self._flow_header = rt.settings.flow_header

    async def __call__(self, scope: Scope, receive: Any, send: Any) -> None:
        rt = self.rt
        t0 = time.perf_counter()
        path: str = scope["path"]
        endpoint = "chat" if path.endswith("chat/completions") else "completions"
        auth = rid = flow_hdr = None
        for name, value in scope["headers"]:
            if name == b"authorization":
                auth = value
            elif name == b"x-request-id":
                rid = value
            elif name == b"x-pd-flow":
                flow_hdr = value
        if rid is None or not VALID_ID.match(rid.decode("latin-1")):
            rid = self._ids.next().encode()
        extra = [(b"x-request-id", rid)]
        flow = self._flow_default
        try:
            if rt.api_keys and not _authorized(auth, rt.api_keys):
                raise Unauthorized("missing or invalid API key")
            if self._flow_header and flow_hdr:
                flow = _flow_of(flow_hdr)
            rt.admission.enter()
        except ProxyError as exc:
            rt.metrics.rejected.labels(reason=exc.kind).inc()
            await _send_error(send, exc, extra)
            return
        try:
            await self._serve(scope, receive, send, endpoint, flow, extra, t0)
        finally:
            rt.admission.leave()

    async def _serve(
        self,
        scope: Scope,
        receive: Any,
        send: Any,
        endpoint: str,
        flow: Flow,
        extra: list[tuple[bytes, bytes]],
        t0: float,
    ) -> None:
        rt = self.rt
        assert rt.dispatcher is not None
        try:
            req = ClientRequest.parse(await _read_body(receive), endpoint == "chat")
        except _Disconnected:
            return
        except ProxyError as exc:
            rt.metrics.rejected.labels(reason=exc.kind).inc()
            await _send_error(send, exc, extra)
            return
        task = asyncio.current_task()
        assert task is not None
        gone = False

        async def watch() -> None:
            nonlocal gone
            while (await receive())["type"] != "http.disconnect":
                pass
            gone = True
            task.cancel()

        watcher = asyncio.get_running_loop().create_task(watch())
        rt.metrics.inflight.inc()
        up: Upstream | None = None
        d: Instance | None = None
        used = flow
        started = complete = False
        outcome, status = "ok", 200
        try:
            up, d, used = await rt.dispatcher.open(req, scope["path"], flow)
            headers = [(b"content-type", up.content_type), *extra]
            if not req.stream:
                body = fix_body(up.first, up.prefill_cached)
                headers.append((b"content-length", str(len(body)).encode()))
                watcher.cancel()
                await send({"type": "http.response.start", "status": 200, "headers": headers})
                started = True
                await send({"type": "http.response.body", "body": body})
                complete = True
            else:
                headers.append((b"cache-control", b"no-cache"))
                await send({"type": "http.response.start", "status": 200, "headers": headers})
                started = True
                complete = await relay_stream(up, send, req.include_usage)
                if not complete:
                    outcome = "stream_error"
                watcher.cancel()
                await send({"type": "http.response.body", "body": b""})
        except ProxyError as exc:
            outcome, status = exc.kind, exc.status
            watcher.cancel()
            if not started:
                await _send_error(send, exc, extra)
            else:
                await send({"type": "http.response.body", "body": sse_error_event(exc.message)})
        except asyncio.CancelledError:
            if not gone or task.uncancel() > 0:
                raise
            outcome, status = "client_disconnected", 499
            log.info("client went away (%s); legs cancelled", extra[0][1].decode())
        finally:
            watcher.cancel()
            if up is not None:
                if complete:
                    up.release()
                else:
                    up.close()
                    if up.binding_tracked and self.rt.events is not None:
                        self.rt.events.post(up.tid, BindingState.ABORTED, outcome)
            if d is not None:
                d.release(req.tokens)
            rt.metrics.inflight.dec()
            if outcome != "ok" or log.isEnabledFor(logging.DEBUG):
                log.log(
                    logging.DEBUG if outcome == "ok" else logging.INFO,
                    "request id=%s tid=%s flow=%s decode=%s outcome=%s status=%d ms=%.1f",
                    extra[0][1].decode(), up.tid if up else "-", used.value,
                    d.url if d else "-", outcome, status, (time.perf_counter() - t0) * 1000,
                )  # fmt: skip
            rt.metrics.requests.labels(endpoint, used.value, outcome, str(status)).inc()
            rt.metrics.total_seconds.labels(used.value).observe(time.perf_counter() - t0)


def _authorized(auth: bytes | None, keys: frozenset[str]) -> bool:
    if auth is None or not auth.startswith(b"Bearer "):
        return False
    return auth[7:].decode("latin-1").strip() in keys


def _flow_of(raw: bytes) -> Flow:
    try:
        return Flow(raw.decode("latin-1"))
    except ValueError:
        raise BadRequest(f"unknown x-pd-flow {raw.decode('latin-1')!r}") from None


async def _read_body(receive: Any) -> bytes:
    chunks: list[bytes] = []
    while True:
        msg = await receive()
        if msg["type"] == "http.disconnect":
            raise _Disconnected
        chunks.append(msg.get("body", b""))
        if not msg.get("more_body"):
            return chunks[0] if len(chunks) == 1 else b"".join(chunks)


async def _send_error(send: Any, exc: ProxyError, extra: list[tuple[bytes, bytes]]) -> None:
    body = exc.body()
    headers = [(b"content-type", _JSON), (b"content-length", str(len(body)).encode()), *extra]
    if exc.retry_after is not None:
        headers.append((b"retry-after", str(max(1, round(exc.retry_after))).encode()))
    await send({"type": "http.response.start", "status": exc.status, "headers": headers})
    await send({"type": "http.response.body", "body": body})
