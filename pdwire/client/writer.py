"""``BackgroundWriter``: the blocking metaserver client's fire-and-forget front.

vLLM's scheduler thread must never wait on the network, so the connector hands writes to a
``BackgroundWriter``: ``submit`` puts the call on a bounded queue and returns at once (``False``
if the queue is full); a few daemon threads (``lanes``) perform the calls with retries and
report each outcome to an optional callback (from that thread). Calls about one binding or one
instance run one after another, in submission order (a binding's ``PUT`` before its events);
calls about different ones run side by side, so one slow or failing write (5 s timeouts, 3
retries) delays only the calls queued behind it for the same binding. A lane that finds several
calls ready at once (a busy engine) sends them as one ``POST /v1/batch``, each answered as if
sent alone.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, replace

from pdwire.client import _protocol as P
from pdwire.client.errors import ConflictError, MetaserverHTTPError, error_for_status
from pdwire.client.sync import MetaserverClient
from pdwire.models import BATCH_MAX_CALLS, BindingSpec, BindingState, EventDetail

log = logging.getLogger("pdgate.pdwire.client")


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


def _jobs_of(item: object) -> list[_Job]:
    if isinstance(item, _Fanout):
        return list(item.jobs)
    assert isinstance(item, _Job), item
    return [item]


class BackgroundWriter:
    """Bounded queue + ``lanes`` threads in front of a ``MetaserverClient`` (one connection per
    thread). ``submit`` never blocks."""

    def __init__(
        self,
        client: MetaserverClient,
        *,
        maxsize: int = 4096,
        lanes: int = 4,
        batch_max: int = 64,
    ) -> None:
        """``batch_max``: a lane that finds several calls ready sends up to this many as one
        ``POST /v1/batch`` (1: every call on its own)."""
        if lanes < 1:
            raise ValueError(f"lanes must be >= 1, not {lanes}")
        if not 1 <= batch_max <= BATCH_MAX_CALLS:
            raise ValueError(f"batch_max must be within 1..{BATCH_MAX_CALLS}, not {batch_max}")
        self.client = client
        self._max = maxsize
        self._batch_max = batch_max
        self.batches = 0  # POST /v1/batch calls made
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

    @property
    def batching(self) -> bool:
        """Whether ready calls go out as batches (off with ``batch_max=1``, and for good once
        the metaserver turned out to have no ``POST /v1/batch``)."""
        return self._batch_max > 1

    def pending(self) -> int:
        """Calls submitted and not finished (queued or running)."""
        with self._lock:
            return self._pending

    def _run(self) -> None:
        while True:
            first = self._ready.get()
            if first is _STOP:
                return
            jobs = self._take(first)
            try:
                if len(jobs) == 1:
                    self._perform(jobs[0])
                else:
                    self._perform_batch(jobs)
            finally:
                with self._lock:
                    for job in jobs:
                        self._pending -= 1
                        waiting = self._behind[job.key]
                        if waiting:
                            self._ready.put(waiting.popleft())
                        else:
                            del self._behind[job.key]
                    if self._pending == 0:
                        self._idle.notify_all()

    def _take(self, first: object) -> list[_Job]:
        """The jobs this lane performs now: ``first``, and with batching on, whatever else is
        ready (up to ``batch_max``). Without batching, a fanout's other jobs go to the other
        lanes. Ready jobs never share a key, so a batch holds one call per binding."""
        jobs = _jobs_of(first)
        if self._batch_max > 1:
            while len(jobs) < self._batch_max:
                try:
                    more = self._ready.get_nowait()
                except queue.Empty:
                    break
                if more is _STOP:  # for a lane (maybe this one) to see after this batch
                    self._ready.put(_STOP)
                    break
                jobs += _jobs_of(more)
        for other in jobs[self._batch_max :]:
            self._ready.put(other)
        return jobs[: self._batch_max]

    def _perform(self, job: _Job) -> None:
        try:
            call = job.call if isinstance(job.call, P.Call) else job.call()
            self._report(job, self.client.send(call), None)
        except Exception as exc:  # reported to the callback, never raised in this thread
            self._report(job, None, exc)

    def _perform_batch(self, jobs: list[_Job]) -> None:
        """One ``POST /v1/batch`` for ``jobs``; each job's outcome is what its own call would
        have had. A call the batch answered with a retryable status (a 5xx) goes again alone,
        with the client's retries. Batching stops for good when the metaserver has no
        ``/v1/batch`` (404/405: an older one); a batch refused for its body (413, 422) goes
        call by call, so each call gets its own answer."""
        calls: list[tuple[_Job, P.Call]] = []
        for job in jobs:
            try:
                calls.append((job, job.call if isinstance(job.call, P.Call) else job.call()))
            except Exception as exc:
                self._report(job, None, exc)
        if len(calls) < 2:
            for job, call in calls:
                self._perform(replace(job, call=call))
            return
        try:
            content = self.client.send(P.batch([call for _, call in calls]))
            items = P.batch_results(content, len(calls))
        except MetaserverHTTPError as exc:
            if exc.status in (404, 405, 413, 422):
                if exc.status in (404, 405):
                    log.info("the metaserver has no POST /v1/batch (%s): calls go alone", exc)
                    self._batch_max = 1
                else:
                    log.warning(
                        "metaserver batch of %d refused (%s): calls go alone", len(calls), exc
                    )
                for job, call in calls:
                    self._perform(replace(job, call=call))
                return
            log.warning("metaserver batch of %d calls failed: %s", len(calls), exc)
            for job, _ in calls:  # (401, or a 5xx after the retries: each call alone would too)
                self._report(job, None, exc, logged=True)
            return
        except Exception as exc:  # unreachable after the retries, or an unreadable answer
            log.warning("metaserver batch of %d calls failed: %s", len(calls), exc)
            for job, _ in calls:
                self._report(job, None, exc, logged=True)
            return
        self.batches += 1
        again: list[_Job] = []  # after every other call's outcome is out
        for (job, call), item in zip(calls, items, strict=True):
            if item.status < 400:
                self._report(job, item.body, None)
            elif self.client.retry.retryable_status(item.status):
                again.append(replace(job, call=call))
            else:
                error = error_for_status(item.status, item.body, call.method, call.path)
                self._report(job, None, error)
        for job in again:
            self._perform(job)

    def _report(
        self, job: _Job, body: bytes | None, error: Exception | None, logged: bool = False
    ) -> None:
        if error is not None and not logged:
            late = job.quiet_conflict and isinstance(error, ConflictError)
            log.log(
                logging.DEBUG if late else logging.WARNING,
                "metaserver %s failed: %s",
                job.describe(),
                error,
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
