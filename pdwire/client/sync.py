"""Blocking metaserver client, and ``BackgroundWriter``: its fire-and-forget front.

vLLM's scheduler thread must never wait on the network, so the connector hands writes to a
``BackgroundWriter``: ``submit`` puts the call on a bounded queue and returns at once (``False``
if the queue is full); a few daemon threads (``lanes``) perform the calls with retries and
report each outcome to an optional callback (from that thread). Calls about one binding or one
instance run one after another, in submission order (a binding's ``PUT`` before its events);
calls about different ones run side by side, so one slow or failing write (5 s timeouts, 3
retries) delays only the calls queued behind it for the same binding.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from types import TracebackType

import httpx

from pdwire.client import _protocol as P
from pdwire.client.errors import (
    ConflictError,
    MetaserverUnavailable,
    NotFoundError,
    error_for_status,
)
from pdwire.client.exchange import Exchange, ExchangeError, HttpxExchange, PlainExchange
from pdwire.client.retry import RetryPolicy
from pdwire.models import (
    Binding,
    BindingSpec,
    BindingState,
    EventDetail,
    Instance,
    InstanceSpec,
    MarkDetail,
    MarkKind,
)

log = logging.getLogger("pdgate.pdwire.client")


class MetaserverClient:
    def __init__(
        self,
        base_url: str,
        *,
        token: str | None = None,
        timeout_s: float = 5.0,
        retry: RetryPolicy | None = None,
        transport: httpx.BaseTransport | None = None,
    ) -> None:
        """``transport``: serve the calls through httpx with it (tests); by default they go
        through ``PlainExchange`` (pdwire/client/exchange.py: why)."""
        self.base_url = base_url.rstrip("/")
        self._timeout = timeout_s
        self._retry = retry or RetryPolicy()
        headers = P.headers(token)
        self._exchange: Exchange = (
            PlainExchange(self.base_url, headers)
            if transport is None
            else HttpxExchange(self.base_url, headers, transport)
        )
        self._closed = False

    def close(self) -> None:
        self._closed = True
        self._exchange.close()

    def __enter__(self) -> MetaserverClient:
        return self

    def __exit__(
        self, t: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def send(self, call: P.Call) -> bytes:
        attempt = 0
        while True:
            attempt += 1
            try:
                status, content = self._exchange.request(
                    call.method,
                    call.path,
                    call.params,
                    call.body,
                    self._timeout + call.extra_timeout,
                )
            except ExchangeError as exc:
                if attempt > self._retry.retries or self._closed:
                    raise MetaserverUnavailable(
                        f"{call.method} {self.base_url}{call.path} failed after {attempt} "
                        f"attempts: {exc!r}"
                    ) from exc
            else:
                if status < 400:
                    return content
                if not self._retry.retryable_status(status) or attempt > self._retry.retries:
                    raise error_for_status(status, content, call.method, call.path)
            time.sleep(self._retry.backoff.compute(attempt))

    def put_binding(self, transfer_id: str, spec: BindingSpec) -> Binding:
        return P.decode(Binding, self.send(P.put_binding(transfer_id, spec)))

    def get_binding(
        self, transfer_id: str, *, wait: float | None = None, state: BindingState | None = None
    ) -> Binding:
        return P.decode(Binding, self.send(P.get_binding(transfer_id, wait, state)))

    def find_binding(self, transfer_id: str) -> Binding | None:
        try:
            return self.get_binding(transfer_id)
        except NotFoundError:
            return None

    def delete_binding(self, transfer_id: str) -> None:
        self.send(P.delete_binding(transfer_id))

    def post_event(
        self, transfer_id: str, state: BindingState, actor: str, detail: EventDetail | None = None
    ) -> Binding:
        return P.decode(Binding, self.send(P.post_event(transfer_id, state, actor, detail)))

    def post_mark(
        self, transfer_id: str, mark: MarkKind, actor: str, detail: MarkDetail | None = None
    ) -> None:
        """Record a moment that is not a state (``first_token``, ``end``); once per kind.
        Answered ``204``: nothing to decode."""
        self.send(P.post_mark(transfer_id, mark, actor, detail))

    def put_instance(self, instance_id: str, spec: InstanceSpec) -> Instance:
        return P.decode(Instance, self.send(P.put_instance(instance_id, spec)))

    def get_instance(self, instance_id: str) -> Instance:
        return P.decode(Instance, self.send(P.get_instance(instance_id)))

    def list_instances(self, role: str | None = None) -> list[Instance]:
        return P.decode_list(Instance, "instances", self.send(P.list_instances(role)))

    def delete_instance(self, instance_id: str) -> None:
        self.send(P.delete_instance(instance_id))

    def set_draining(self, instance_id: str, draining: bool = True) -> Instance:
        """Drain (or undrain) a registered instance; ``NotFoundError`` if it is not."""
        return P.decode(Instance, self.send(P.drain_instance(instance_id, draining)))


Outcome = Callable[[bytes | None, Exception | None], None]


@dataclass(frozen=True, slots=True)
class _Job:
    call: P.Call | Callable[[], P.Call]  # a callable is built on the lane's thread
    on_done: Outcome | None
    quiet_conflict: bool  # a 409 is expected (another process got there first)
    key: str  # what the call is about: calls with one key keep their order

    def describe(self) -> str:
        return f"{self.call.method} {self.call.path}" if isinstance(self.call, P.Call) else self.key


@dataclass(frozen=True, slots=True)
class BindingWrite:
    """A binding for ``BackgroundWriter.put_bindings``. ``spec`` may be a callable: the body is
    then built and serialised on the writer's thread, not the caller's."""

    transfer_id: str
    spec: BindingSpec | Callable[[], BindingSpec]
    on_done: Outcome | None = None

    def job(self) -> _Job:
        tid, spec = self.transfer_id, self.spec
        call: P.Call | Callable[[], P.Call]
        if isinstance(spec, BindingSpec):
            call = P.put_binding(tid, spec)
        else:
            call = lambda: P.put_binding(tid, spec())  # noqa: E731
        return _Job(call, self.on_done, False, _order_key(P.binding_path(tid)))


def _order_key(path: str) -> str:
    """``/v1/bindings/{id}`` for a binding and its events, ``/v1/instances/{id}``."""
    return "/".join(path.split("/")[:4])


_STOP = object()


@dataclass(frozen=True, slots=True)
class _Fanout:
    """Jobs that became ready together: one wake-up for the submitting thread (vLLM's
    scheduler), the lane that takes it queues the rest."""

    jobs: list[_Job]


class BackgroundWriter:
    """Bounded queue + ``lanes`` threads in front of a ``MetaserverClient`` (one connection per
    thread). ``submit`` never blocks."""

    def __init__(self, client: MetaserverClient, *, maxsize: int = 4096, lanes: int = 4) -> None:
        if lanes < 1:
            raise ValueError(f"lanes must be >= 1, not {lanes}")
        self.client = client
        self._max = maxsize
        self._ready: queue.SimpleQueue[_Job | _Fanout | object] = queue.SimpleQueue()
        # key -> calls submitted behind the one of that key now ready or running
        self._behind: dict[str, deque[_Job]] = {}
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)
        self._pending = 0  # submitted, not finished
        self.dropped = 0
        self.failed = 0
        self.completed = 0
        self._threads = [
            threading.Thread(target=self._run, name=f"pdgate-metaserver-writer-{i}", daemon=True)
            for i in range(lanes)
        ]
        for t in self._threads:
            t.start()

    def submit(
        self, call: P.Call, on_done: Outcome | None = None, quiet_conflict: bool = False
    ) -> bool:
        return self._enqueue([_Job(call, on_done, quiet_conflict, _order_key(call.path))]) == 1

    def _enqueue(self, jobs: list[_Job]) -> int:
        """Queue ``jobs`` in order under one lock; those past the queue's bound are dropped.
        Returns how many were queued (the first ones). The caller wakes one lane at most:
        several jobs ready at once go out as one ``_Fanout`` that the lane spreads."""
        ready: list[_Job] = []
        with self._lock:
            room = max(0, min(len(jobs), self._max - self._pending))
            self._pending += room
            for job in jobs[:room]:
                waiting = self._behind.get(job.key)
                if waiting is None:
                    self._behind[job.key] = deque()
                    ready.append(job)
                else:
                    waiting.append(job)
            self.dropped += len(jobs) - room
        if len(ready) == 1:
            self._ready.put(ready[0])
        elif ready:
            self._ready.put(_Fanout(ready))
        for job in jobs[room:]:
            log.warning("metaserver write queue full; dropped %s", job.describe())
        return room

    def put_binding(
        self, transfer_id: str, spec: BindingSpec, on_done: Outcome | None = None
    ) -> bool:
        return self.put_bindings([BindingWrite(transfer_id, spec, on_done)]) == 1

    def put_bindings(self, writes: list[BindingWrite]) -> int:
        """Queue several bindings at once (one lock, one wake-up per lane at most); returns how
        many were queued: the first ones, the rest were dropped (queue full)."""
        return self._enqueue([w.job() for w in writes])

    def post_event(
        self,
        transfer_id: str,
        state: BindingState,
        actor: str,
        detail: EventDetail | None = None,
        on_done: Outcome | None = None,
        quiet_conflict: bool = False,
    ) -> bool:
        """``quiet_conflict``: the event may legitimately arrive after a later state (posted by
        another process), so a 409 is logged at debug level instead of as a warning."""
        call = P.post_event(transfer_id, state, actor, detail)
        return self.submit(call, on_done, quiet_conflict)

    def pending(self) -> int:
        """Calls submitted and not finished (queued or running)."""
        with self._lock:
            return self._pending

    def _run(self) -> None:
        while True:
            job = self._ready.get()
            if job is _STOP:
                return
            if isinstance(job, _Fanout):  # the other lanes get the rest, woken from here
                for other in job.jobs[1:]:
                    self._ready.put(other)
                job = job.jobs[0]
            assert isinstance(job, _Job)
            try:
                self._perform(job)
            finally:
                with self._lock:
                    self._pending -= 1
                    waiting = self._behind[job.key]
                    if waiting:
                        self._ready.put(waiting.popleft())
                    else:
                        del self._behind[job.key]
                    if self._pending == 0:
                        self._idle.notify_all()

    def _perform(self, job: _Job) -> None:
        body: bytes | None = None
        error: Exception | None = None
        try:
            call = job.call if isinstance(job.call, P.Call) else job.call()
            body = self.client.send(call)
        except Exception as exc:  # reported to the callback, never raised in this thread
            error = exc
            late = job.quiet_conflict and isinstance(exc, ConflictError)
            log.log(
                logging.DEBUG if late else logging.WARNING,
                "metaserver %s failed: %s",
                job.describe(),
                exc,
            )
        with self._lock:
            if error is None:
                self.completed += 1
            else:
                self.failed += 1
        if job.on_done is not None:
            try:
                job.on_done(body, error)
            except Exception:
                log.exception("metaserver write callback raised")

    def close(self, timeout_s: float = 5.0) -> None:
        """Finish submitted writes (up to ``timeout_s``), stop the threads, close the client."""
        deadline = time.monotonic() + timeout_s
        with self._lock:
            self._idle.wait_for(lambda: self._pending == 0, timeout_s)
        for _ in self._threads:
            self._ready.put(_STOP)
        for t in self._threads:
            t.join(max(0.0, deadline - time.monotonic()))
        self.client.close()
