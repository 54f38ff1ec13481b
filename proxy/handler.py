"""The hot path: ``POST /v1/completions`` and ``/v1/chat/completions`` as a lean ASGI handler.

Raw body, one JSON parse, SSE bytes passed through. A watcher notices a client that goes away
(``proxy.server``'s protocol calls it; elsewhere a task on ``receive()``) and cancels the
request at once: both legs are dropped (closing a connection
aborts a vLLM request), load is released in ``finally``, the binding is marked ``aborted``.
With ``--binding-marks``, a decode-first request's binding gets its ``first_token`` and ``end``
marks, posted in the background (``proxy.events``).
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import time
from typing import TYPE_CHECKING, Any

from pdservice.asgi import (
    BodyTimeout,
    BodyTooLarge,
    ClientDisconnected,
    Receive,
    Scope,
    Send,
    read_body,
)
from pdwire.ids import IdMaker, valid_id
from pdwire.models import BindingState, MarkKind
from proxy.answers import EVENT_STREAM, JSON, not_a_completion, not_an_event_stream
from proxy.backend import LegError
from proxy.config import Flow
from proxy.early import EarlyFirst
from proxy.errors import (
    BadRequest,
    PayloadTooLarge,
    ProxyError,
    RequestTimeout,
    Unauthorized,
    UpstreamError,
    sse_error_event,
)
from proxy.flows import Upstream
from proxy.instances import Instance, Role
from proxy.migration import COMPLETIONS, Migrator, Splicer, Tape
from proxy.rewrite import ClientRequest
from proxy.runtime import Runtime
from proxy.sse import EventHook, end_broken, fix_body, relay_stream
from proxy.tracing import NO_SPAN
from proxy.watcher import Watcher

if TYPE_CHECKING:
    from proxy.tracing import RequestSpan

log = logging.getLogger("pdgate.proxy")
HOT_PATHS = frozenset({"/v1/completions", "/v1/chat/completions"})
_JSON = b"application/json"


class _Serving:
    """The upstream and D a request holds now (migration replaces them), and the prompt size
    ``d`` was acquired with."""

    __slots__ = ("d", "held", "up")

    def __init__(self, held: int) -> None:
        self.up: Upstream | None = None
        self.d: Instance | None = None
        self.held = held


class CompletionsHandler:
    def __init__(self, rt: Runtime) -> None:
        self.rt = rt
        self._ids = IdMaker("req")
        self._flow_default = rt.settings.flow
        self._flow_header = rt.settings.flow_header
        self._max_body = rt.settings.max_body_bytes
        self._receipt_s = rt.settings.receipt_timeout_s
        self._max_choices = rt.settings.max_choices
        self._marks = rt.settings.binding_marks  # the timeline's first_token / end marks
        self._counters: dict[tuple[str, Flow, str, int], Any] = {}
        self._migrator = Migrator(rt.settings.migration_limit, rt.metrics)
        self._early = rt.settings.early_first_token
        self._histograms: dict[Flow, Any] = {}

    async def _relay(
        self,
        at: _Serving,
        req: ClientRequest,
        tape: Tape | None,
        send: Send,
        watcher: Watcher,
        flow: Flow,
        t0: float,
        span: RequestSpan,
        hook: EventHook | None = None,
    ) -> bool:
        """Stream D's answer to the client; when D breaks mid-stream, go on from another pair
        while the migrator allows (``proxy.migration``), else end with an error event.
        ``hook``: the first answer's (P's first token went out: ``proxy.early``). Returns
        whether the client got the whole answer."""
        assert at.up is not None and at.d is not None
        if hook is None and tape is not None:
            hook = self._migrator.hook(req, tape)
        broken = await relay_stream(at.up, send, req.include_usage, watcher.finish, hook)
        gone: set[str] = set()  # the D that broke, each time: never asked again
        while broken is not None:
            gone.add(at.d.url)
            others = self.rt.registry.available(Role.DECODE, frozenset(gone))
            plan = self._migrator.plan(req, tape, broken, elsewhere=bool(others))
            if plan.request is None:
                if plan.closing:  # D broke after its last token: the client has it all
                    await send({"type": "http.response.body", "body": plan.closing})
                    return True
                log.info("not migrated (%s): %s", plan.outcome, plan.why)
                await end_broken(send, broken, f"not continued elsewhere: {plan.why}")
                return False
            assert tape is not None and at.up is not None and at.d is not None
            self._leave(at.up, at.d, at.held, t0, span)
            at.up = at.d = None
            try:
                assert self.rt.dispatcher is not None
                at.up, at.d, _ = await self.rt.dispatcher.open(
                    plan.request, COMPLETIONS, flow, span, frozenset(gone)
                )
            except ProxyError:
                self._migrator.counted(broken, "failed")
                raise
            at.held = plan.request.tokens
            self._migrator.counted(broken, "continued")
            if self._marks and at.up.binding_tracked:
                since = time.perf_counter() - t0
                self.rt.events.mark(at.up.tid, MarkKind.FIRST_TOKEN, since, kv_held=at.up.kv_held)
            log.info("answer of %s continues on %s after %d tokens (%s)",
                     at.up.tid, at.d.url, tape.shown, broken.reason)  # fmt: skip
            hook = Splicer(req, tape).event
            broken = await relay_stream(at.up, send, False, watcher.finish, hook)
        return True

    def _leave(self, up: Upstream, d: Instance, held: int, t0: float, span: RequestSpan) -> None:
        """Drop a D that broke mid-stream before its answer goes on from another pair: its
        answer closed (vLLM aborts the request), its load released, a failure on its circuit,
        the binding marked ``migrated``."""
        rt = self.rt
        self._abort(up, "migrated")
        assert rt.dispatcher is not None
        rt.dispatcher.release(d, held)
        d.circuit.record(False)
        if up.binding_tracked:
            rt.events.mark(up.tid, MarkKind.MIGRATED, time.perf_counter() - t0, d.url[:64])
        span.event("migrated", {"pdgate.transfer_id": up.tid, "server.address": d.url})

    def _abort(self, up: Upstream, why: str) -> None:
        """Drop D's answer (vLLM aborts the request) and mark its bindings ``abandoned``."""
        up.close()
        if up.binding_tracked:
            for bid in up.binding_ids or (up.tid,):
                self.rt.events.abandon(bid, BindingState.ABORTED, why)

    def _count(self, endpoint: str, flow: Flow, outcome: str, status: int) -> Any:
        """The label child of ``pd_requests_total``, resolved once per label set."""
        key = (endpoint, flow, outcome, status)
        child = self._counters.get(key)
        if child is None:
            child = self._counters[key] = self.rt.metrics.requests.labels(
                endpoint, flow.value, outcome, str(status)
            )
        return child

    def _seconds(self, flow: Flow) -> Any:
        child = self._histograms.get(flow)
        if child is None:
            child = self._histograms[flow] = self.rt.metrics.total_seconds.labels(flow.value)
        return child

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        rt = self.rt
        t0 = time.perf_counter()
        path: str = scope["path"]
        endpoint = "chat" if path.endswith("chat/completions") else "completions"
        auth = rid = flow_hdr = None
        declared = 0
        for name, value in scope["headers"]:
            if name == b"authorization":
                auth = value
            elif name == b"x-request-id":
                rid = value
            elif name == b"x-pd-flow":
                flow_hdr = value
            elif name == b"content-length":
                declared = int(value) if value.isdigit() else 0
        if rid is None or not valid_id(rid.decode("latin-1")):
            rid = self._ids.next().encode()
        extra = [(b"x-request-id", rid)]
        flow = self._flow_default
        span: RequestSpan = NO_SPAN
        if rt.tracer is not None:  # tracing on: only then is traceparent looked for
            tp = next((v for n, v in scope["headers"] if n == b"traceparent"), None)
            span = rt.tracer.request(tp, path, rid.decode("latin-1"))
        try:
            if declared > self._max_body:
                raise PayloadTooLarge(f"request body exceeds {self._max_body} bytes")
            if rt.api_keys and not _authorized(auth, rt.api_keys):
                raise Unauthorized("missing or invalid API key")
            if self._flow_header and flow_hdr:
                flow = _flow_of(flow_hdr)
        except ProxyError as exc:
            rt.metrics.rejected.labels(reason=exc.kind).inc()
            _end_span(span, exc.kind, exc.status, flow, None, None, exc.message)
            await _send_error(send, exc, extra)
            return
        await self._serve(scope, receive, send, endpoint, flow, extra, t0, span)

    async def _serve(
        self,
        scope: Scope,
        receive: Receive,
        send: Send,
        endpoint: str,
        flow: Flow,
        extra: list[tuple[bytes, bytes]],
        t0: float,
        span: RequestSpan = NO_SPAN,
    ) -> None:
        rt = self.rt
        assert rt.dispatcher is not None
        try:
            try:
                body = await read_body(receive, self._max_body, within_s=self._receipt_s)
            except BodyTooLarge as exc:
                raise PayloadTooLarge(str(exc)) from None
            except BodyTimeout as exc:
                raise RequestTimeout(str(exc)) from None
            req = ClientRequest.parse(body, endpoint == "chat", self._max_choices)
            # taken once the body is in: a slow sender holds its connection, not a slot
            rt.admission.enter()
        except ClientDisconnected:
            _end_span(span, "client_disconnected", 499, flow, None, None, "client went away")
            return
        except ProxyError as exc:
            rt.metrics.rejected.labels(reason=exc.kind).inc()
            _end_span(span, exc.kind, exc.status, flow, None, None, exc.message)
            await _send_error(send, exc, extra, close=isinstance(exc, RequestTimeout))
            return
        task = asyncio.current_task()
        assert task is not None
        watcher = Watcher(task, scope, receive)
        rt.metrics.inflight.inc()
        at = _Serving(req.tokens)
        used = flow
        started = complete = False
        outcome, status = "ok", 200
        tape = self._migrator.tape(req)
        stream_headers: list[tuple[bytes, bytes]] = []
        early = None
        if req.stream:  # a non-streamed request builds neither
            stream_headers = [
                (b"content-type", EVENT_STREAM),
                *extra,
                (b"cache-control", b"no-cache"),
            ]
            if self._early:
                early = EarlyFirst.of(req, tape, flow, send, stream_headers, rt.metrics)
        try:
            first, at.d, used = await rt.dispatcher.open(
                req, scope["path"], flow, span, early=early
            )
            at.up, at.held = first, req.tokens  # exact once the kv policy tokenized it
            started = early is not None and early.sent
            if self._marks and first.binding_tracked:  # posted in the background
                since = (early.at if started and early is not None else time.perf_counter()) - t0
                rt.events.mark(first.tid, MarkKind.FIRST_TOKEN, since, kv_held=first.kv_held)
            if not req.stream:
                wrong = not_a_completion(first.first)
                if wrong is not None:  # never a body unread: a registered URL may be anything
                    assert at.d is not None
                    raise LegError(UpstreamError(wrong), at.d.url, "decode")
                headers = [(b"content-type", JSON), *extra]
                body = fix_body(first.first, first.prefill_cached)
                headers.append((b"content-length", str(len(body)).encode()))
                watcher.cancel()
                await send({"type": "http.response.start", "status": 200, "headers": headers})
                started = True
                await send({"type": "http.response.body", "body": body})
                complete = True
            else:
                wrong = not_an_event_stream(first.content_type)
                if wrong is not None:
                    assert at.d is not None
                    raise LegError(UpstreamError(wrong), at.d.url, "decode")
                if not started:
                    await send(
                        {"type": "http.response.start", "status": 200, "headers": stream_headers}
                    )
                    started = True
                hook = early.hook if early is not None and early.sent else None
                complete = await self._relay(at, req, tape, send, watcher, flow, t0, span, hook)
                if not complete:
                    outcome = "stream_error"
                watcher.cancel()
        except ProxyError as exc:
            outcome, status = exc.kind, exc.status
            span.set("error.message", exc.message[:500])
            watcher.cancel()
            if early is not None and early.sent:
                started = True  # P's first token is out: the failure ends the stream
            if not started:
                await _send_error(send, exc, extra)
            else:
                await send({"type": "http.response.body", "body": sse_error_event(exc.public)})
        except asyncio.CancelledError:
            if not watcher.gone or task.uncancel() > 0:
                raise
            outcome, status = "client_disconnected", 499
            log.info("client went away (%s); legs cancelled", extra[0][1].decode())
        finally:
            rt.admission.leave()
            watcher.cancel()
            up, d = at.up, at.d
            if up is not None:
                if complete:
                    up.release()
                else:
                    self._abort(up, outcome)
                if self._marks and up.binding_tracked:
                    chunks = up.chunks if req.stream else None
                    end = time.perf_counter() - t0
                    rt.events.mark(up.tid, MarkKind.END, end, outcome, chunks=chunks)
            if d is not None:
                rt.dispatcher.release(d, at.held)
            rt.metrics.inflight.dec()
            if outcome != "ok" or log.isEnabledFor(logging.DEBUG):
                log.log(
                    logging.DEBUG if outcome == "ok" else logging.INFO,
                    "request id=%s tid=%s flow=%s decode=%s outcome=%s status=%d ms=%.1f",
                    extra[0][1].decode(), up.tid if up else "-", used.value,
                    d.url if d else "-", outcome, status, (time.perf_counter() - t0) * 1000,
                )  # fmt: skip
            self._count(endpoint, used, outcome, status).inc()
            self._seconds(used).observe(time.perf_counter() - t0)
            _end_span(span, outcome, status, used, up, d, None)


def _end_span(
    span: RequestSpan,
    outcome: str,
    status: int,
    flow: Flow,
    up: Upstream | None,
    d: Instance | None,
    error: str | None,
) -> None:
    span.set("pdgate.outcome", outcome)
    span.set("http.response.status_code", status)
    span.set("pdgate.flow", flow.value)
    if up is not None:
        span.set("pdgate.transfer_id", up.tid)
        if up.prefill_cached is not None:
            span.set("pdgate.prefill_cached_tokens", up.prefill_cached)
    if d is not None:
        span.set("pdgate.decode", d.url)
    span.end(None if outcome == "ok" else (error or outcome))


def _authorized(auth: bytes | None, keys: frozenset[bytes]) -> bool:
    """Whether ``auth`` is ``Bearer <one of keys>``, compared in constant time (every key is
    compared, so the time says nothing about which prefix matched)."""
    if auth is None or not auth.startswith(b"Bearer "):
        return False
    got = auth[7:].strip()
    hits = [hmac.compare_digest(got, key) for key in keys]
    return any(hits)


def _flow_of(raw: bytes) -> Flow:
    try:
        return Flow(raw.decode("latin-1"))
    except ValueError:
        raise BadRequest(f"unknown x-pd-flow {raw.decode('latin-1')!r}") from None


async def _send_error(
    send: Any, exc: ProxyError, extra: list[tuple[bytes, bytes]], *, close: bool = False
) -> None:
    """``close``: the connection ends after this answer (the rest of a late body would
    otherwise be read as the next request)."""
    body = exc.body()
    headers = [(b"content-type", _JSON), (b"content-length", str(len(body)).encode()), *extra]
    if close:
        headers.append((b"connection", b"close"))
    if exc.retry_after is not None:
        headers.append((b"retry-after", str(max(1, round(exc.retry_after))).encode()))
    await send({"type": "http.response.start", "status": exc.status, "headers": headers})
    await send({"type": "http.response.body", "body": body})
