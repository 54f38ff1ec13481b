"""In-memory doubles of the proxy's seams, for tests (like httpx's ``MockTransport``).

``MockBackend`` is a ``Backend`` that answers from a script instead of a network: each route,
by leg (``"prefill"``, ``"decode"``, ``"get"`` for the binding long-poll) or by
``(url, leg)``, is a ``Reply``, a list of them (one per call, in order) or a callable
``Call -> Reply`` (sync or async, to build the answer from the request, or to wait).
A ``Reply`` can wait before its headers and between its chunks (seconds, an
``asyncio.Event`` to hang until it is set), fail there (an ``UpstreamError``), stream,
answer non-2xx; timeouts are the ones the proxy passes, as with a real backend. Every call is
recorded with what became of it (``Outcome``: cancelled while pending, failed, answer left
open, released after its end, closed)::

    gate = asyncio.Event()
    backend = MockBackend({
        "decode": Reply.sse(["Hello", " world"]),
        "get": Reply.json({"transfer_id": "t"}),  # D's binding
        "prefill": Reply.completion(kv_transfer_params=push_report(None, None)).after(gate),
    })
    runtime.wire(backend, MockEventClient())  # a proxy.runtime.Runtime, not started

A test steps through a request with ``await backend.called("prefill", waiting=True)`` (the leg
was sent and is held at one of its waits), then releases a gate, cancels, hangs up, ...
As over a network, every call lets the event loop run once before its answer.
``MockEventClient`` stands in for the metaserver client behind ``proxy.events.EventSink``.
"""

from __future__ import annotations

import asyncio
import enum
import inspect
from collections import deque
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from typing import Any, NamedTuple

import msgspec

from pdwire.models import BindingState, MarkDetail, MarkKind
from proxy.backend import LegError, status_error
from proxy.errors import UpstreamError, UpstreamTimeout

GET = "get"  # the leg name of ``Backend.get`` calls (the metaserver binding long-poll)

Wait = float | asyncio.Event | UpstreamError
"""Before headers or between chunks: sleep seconds, wait for the event, or fail."""
Step = bytes | Wait


class Outcome(enum.StrEnum):
    PENDING = "pending"  # sent; the answer's headers are not in yet
    CANCELLED = "cancelled"  # cancelled while pending
    FAILED = "failed"  # the call raised (transport error, timeout, non-2xx)
    ANSWERED = "answered"  # a GET that returned
    OPEN = "open"  # a 2xx answer neither released nor closed
    RELEASED = "released"  # read to its end and released
    CLOSED = "closed"  # dropped (aborts the request on a real backend)


RUNNING = frozenset({Outcome.PENDING, Outcome.OPEN})


class Reply:
    """One scripted answer: ``before`` runs until the headers are in, then ``body``'s chunks
    are read one by one, running the waits between them."""

    __slots__ = ("before", "body", "content_type", "status")

    def __init__(
        self,
        status: int = 200,
        body: Iterable[Step] = (),
        *,
        content_type: bytes = b"application/json",
        before: Iterable[Wait] = (),
    ) -> None:
        self.status = status
        self.body: tuple[Step, ...] = tuple(body)
        self.content_type = content_type
        self.before: tuple[Wait, ...] = tuple(before)

    def after(self, *waits: Wait) -> Reply:
        """This answer (its own waits and failure included) once ``waits`` have run:
        ``Reply.fail().after(gate)`` fails when ``gate`` is set; ``asyncio.Event()`` hangs."""
        return Reply(
            self.status, self.body, content_type=self.content_type, before=(*waits, *self.before)
        )

    @classmethod
    def json(cls, obj: Any, status: int = 200) -> Reply:
        return cls(status, [msgspec.json.encode(obj)])

    @classmethod
    def completion(
        cls, text: str = "ok", *, kv_transfer_params: Any = None, usage: Any = None
    ) -> Reply:
        """A ``/v1/completions`` answer (what P answers, or D when not streaming)."""
        obj: dict[str, Any] = {
            "id": "cmpl-mock",
            "object": "text_completion",
            "choices": [{"index": 0, "text": text, "finish_reason": "length"}],
            "usage": usage,
        }
        if kv_transfer_params is not None:
            obj["kv_transfer_params"] = kv_transfer_params
        return cls.json(obj)

    @classmethod
    def sse(cls, pieces: Iterable[str | Wait], *, done: bool = True) -> Reply:
        """An event stream: one completion chunk per text piece (the waits run in between),
        then ``data: [DONE]`` unless ``done`` is false."""
        body: list[Step] = [sse_event(p) if isinstance(p, str) else p for p in pieces]
        if done:
            body.append(b"data: [DONE]\n\n")
        return cls(200, body, content_type=b"text/event-stream")

    @classmethod
    def fail(cls, message: str = "connection refused") -> Reply:
        """A transport failure before any answer."""
        return cls(before=[UpstreamError(message)])


def sse_event(text: str) -> bytes:
    chunk = {
        "id": "cmpl-mock",
        "object": "text_completion",
        "choices": [{"index": 0, "text": text}],
    }
    return b"data: " + msgspec.json.encode(chunk) + b"\n\n"


class Call:
    """One request the backend got, and what became of it."""

    __slots__ = (
        "body", "headers", "leg", "path", "request_id", "response", "state", "timeout_s",
        "traceparent", "url", "waiting",
    )  # fmt: skip

    def __init__(
        self,
        url: str,
        path: str,
        body: bytes,
        request_id: str,
        leg: str,
        timeout_s: float,
        traceparent: str | None = None,
    ) -> None:
        self.url = url
        self.path = path
        self.body = body
        self.request_id = request_id
        self.traceparent = traceparent  # the header the leg was sent with (tracing on)
        self.leg = leg
        self.timeout_s = timeout_s
        self.state = Outcome.PENDING
        self.response: MockResponse | None = None
        self.headers: dict[str, str] | None = None  # a GET's extra headers (the bearer token)
        self.waiting = False  # held at one of its reply's waits (before headers, between chunks)

    @property
    def outcome(self) -> Outcome:
        return self.state if self.response is None else self.response.state

    def json(self) -> Any:
        return msgspec.json.decode(self.body)

    @property
    def transfer_id(self) -> str:
        """The transfer an engine call is part of (its ``kv_transfer_params``); the engines'
        request id (``request_id``) is another. ``LookupError`` for a call without one."""
        kv = self.json().get("kv_transfer_params") if self.body[:1] == b"{" else None
        tid = kv.get("transfer_id") if isinstance(kv, dict) else None
        if not isinstance(tid, str):
            raise LookupError(f"{self!r} carries no transfer id")
        return tid

    def __repr__(self) -> str:
        return f"Call({self.leg} {self.url}{self.path} {self.request_id}: {self.outcome})"


Handler = Callable[[Call], Reply | Awaitable[Reply]]
Route = Reply | Sequence[Reply] | Handler
RouteKey = str | tuple[str, str]


async def _wait(step: Wait, call: Call, notify: Callable[[], None]) -> None:
    if isinstance(step, UpstreamError):
        raise step
    call.waiting = True
    notify()
    try:
        if isinstance(step, asyncio.Event):
            await step.wait()
        else:
            await asyncio.sleep(step)
    finally:
        call.waiting = False


class MockResponse:
    """A 2xx answer being read: the ``Response`` of ``MockBackend``."""

    __slots__ = (
        "_call", "_idle", "_notify", "_steps", "chunks_read", "content_type", "state", "status",
    )  # fmt: skip

    def __init__(
        self, reply: Reply, call: Call, notify: Callable[[], None], idle_timeout_s: float | None
    ) -> None:
        self._call = call
        self._notify = notify
        self.status = reply.status
        self.content_type = reply.content_type
        self._steps: deque[Step] = deque(reply.body)
        self._idle = idle_timeout_s
        self.chunks_read = 0
        self.state = Outcome.OPEN

    async def _next(self) -> bytes:
        if self.state == Outcome.CLOSED:
            raise UpstreamError("read after close")
        while self._steps:
            step = self._steps.popleft()
            if isinstance(step, bytes):
                self.chunks_read += 1
                return step
            await _wait(step, self._call, self._notify)
        return b""

    async def read(self, timeout_s: float) -> bytes:
        parts: list[bytes] = []
        try:
            async with asyncio.timeout(timeout_s):
                while chunk := await self._next():
                    parts.append(chunk)
        except TimeoutError as exc:
            raise UpstreamTimeout(f"no complete answer in {timeout_s}s") from exc
        return b"".join(parts)

    async def next_chunk(self, timeout_s: float | None = None) -> bytes:
        limit = self._idle if timeout_s is None else timeout_s
        try:
            async with asyncio.timeout(limit):
                return await self._next()
        except TimeoutError as exc:
            raise UpstreamTimeout(f"no data in {limit}s") from exc

    def release(self) -> None:
        if self.state == Outcome.OPEN:
            self.state = Outcome.RELEASED

    def close(self) -> None:
        self.state = Outcome.CLOSED


class MockBackend:
    """A ``Backend`` answering from ``routes`` (see the module's docstring); ``calls`` records
    every request in order. An unrouted call (or a list of replies run dry) raises
    ``LookupError``: the test is missing a route."""

    def __init__(
        self, routes: Mapping[RouteKey, Route] | None = None, *, idle_timeout_s: float | None = None
    ) -> None:
        self._routes: dict[RouteKey, Route] = dict(routes or {})
        self._queues: dict[RouteKey, deque[Reply]] = {}
        self._idle = idle_timeout_s
        self._changed = asyncio.Event()
        self.calls: list[Call] = []
        self.closed = False

    def route(self, key: RouteKey, route: Route) -> None:
        """Set (or replace) the answer of a leg, or of ``(url, leg)``."""
        self._routes[key] = route
        self._queues.pop(key, None)

    def calls_of(self, leg: str, url: str | None = None) -> list[Call]:
        return [c for c in self.calls if c.leg == leg and (url is None or c.url == url)]

    @property
    def running(self) -> list[Call]:
        """Calls still pending or with an answer neither released nor closed."""
        return [c for c in self.calls if c.outcome in RUNNING]

    async def called(
        self, leg: str, *, count: int = 1, waiting: bool = False, within: float = 1.0
    ) -> Call:
        """Wait until the ``count``-th call of ``leg`` has arrived (and, with ``waiting``, is
        held at one of its reply's waits: what sent it is suspended there too); return it."""
        async with asyncio.timeout(within):
            while True:
                found = self.calls_of(leg)
                if len(found) >= count and (found[count - 1].waiting or not waiting):
                    return found[count - 1]
                await self._changed.wait()

    def _notify(self) -> None:
        changed, self._changed = self._changed, asyncio.Event()
        changed.set()

    async def _reply(self, call: Call) -> Reply:
        key: RouteKey = (call.url, call.leg)
        if key not in self._routes:
            key = call.leg
        route = self._routes.get(key)
        if route is None:
            raise LookupError(f"MockBackend: no route for {call.leg} {call.url}")
        if isinstance(route, Reply):
            return route
        if isinstance(route, Sequence):
            queue = self._queues.setdefault(key, deque(route))
            if not queue:
                raise LookupError(f"MockBackend: no reply left for {call.leg} {call.url}")
            return queue.popleft()
        out = route(call)
        return await out if inspect.isawaitable(out) else out

    async def _headers(self, call: Call) -> Reply:
        """Record the call, run its reply's waits until the headers (within its timeout)."""
        self.calls.append(call)
        self._notify()
        try:
            async with asyncio.timeout(call.timeout_s):
                await asyncio.sleep(0)  # as over a network, the loop runs before any answer
                reply = await self._reply(call)
                for step in reply.before:
                    await _wait(step, call, self._notify)
        except asyncio.CancelledError:
            call.state = Outcome.CANCELLED
            raise
        except TimeoutError as exc:
            call.state = Outcome.FAILED
            raise UpstreamTimeout(f"no answer in {call.timeout_s}s") from exc
        except BaseException:
            call.state = Outcome.FAILED
            raise
        return reply

    async def post(
        self,
        url: str,
        path: str,
        body: bytes,
        request_id: str,
        leg: str,
        timeout_s: float,
        traceparent: str | None = None,
    ) -> MockResponse:
        call = Call(url, path, body, request_id, leg, timeout_s, traceparent)
        try:
            reply = await self._headers(call)
        except UpstreamError as exc:
            raise LegError(exc, url, leg) from exc
        resp = MockResponse(reply, call, self._notify, self._idle)
        if reply.status >= 300:
            try:
                raw = await resp.read(5.0)
            except UpstreamError:
                raw = b""
            call.state = Outcome.FAILED
            raise status_error(reply.status, raw, url, leg)
        call.response = resp
        return resp

    async def get(
        self, url: str, headers: dict[str, str] | None, timeout_s: float
    ) -> tuple[int, bytes]:
        call = Call(url, "", b"", "", GET, timeout_s)
        call.headers = headers
        reply = await self._headers(call)
        resp = MockResponse(reply, call, self._notify, self._idle)
        try:
            raw = await resp.read(timeout_s)
        except asyncio.CancelledError:
            call.state = Outcome.CANCELLED
            raise
        except BaseException:
            call.state = Outcome.FAILED
            raise
        call.state = Outcome.ANSWERED
        return reply.status, raw

    async def close(self) -> None:
        self.closed = True


class RecordedAbandon(NamedTuple):
    """An ``abandoned`` mark: the proxy gave up on the transfer's KV (``outcome``: failed or
    aborted), and why."""

    transfer_id: str
    outcome: BindingState
    actor: str
    message: str | None


class RecordedMark(NamedTuple):
    transfer_id: str
    mark: MarkKind
    actor: str
    detail: MarkDetail | None


class MockEventClient:
    """The metaserver client behind ``proxy.events.EventSink``: records the marks, and the
    ``abandoned`` ones apart (``abandoned``)."""

    def __init__(self) -> None:
        self.abandoned: list[RecordedAbandon] = []
        self.marks: list[RecordedMark] = []

    async def post_mark(
        self, transfer_id: str, mark: MarkKind, actor: str, detail: MarkDetail | None = None
    ) -> None:
        if mark is MarkKind.ABANDONED:
            assert detail is not None and detail.outcome is not None
            outcome = BindingState(detail.outcome)
            self.abandoned.append(RecordedAbandon(transfer_id, outcome, actor, detail.message))
            return
        self.marks.append(RecordedMark(transfer_id, mark, actor, detail))


__all__ = [
    "GET",
    "Call",
    "MockBackend",
    "MockEventClient",
    "MockResponse",
    "Outcome",
    "RecordedAbandon",
    "RecordedMark",
    "Reply",
    "Step",
    "Wait",
    "sse_event",
]
