"""Blocking metaserver client, and ``BackgroundWriter``: its fire-and-forget front.

vLLM's scheduler thread must never wait on the network, so the connector hands writes to a
``BackgroundWriter``: ``submit`` puts the call on a bounded queue and returns at once (``False``
if the queue is full); one daemon thread performs the calls with retries and reports each
outcome to an optional callback (from that thread).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
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
from pdwire.client.retry import RetryPolicy
from pdwire.models import (
    Binding,
    BindingSpec,
    BindingState,
    EventDetail,
    Instance,
    InstanceSpec,
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
        headers = {"content-type": "application/json"}
        if token:
            headers["authorization"] = f"Bearer {token}"
        self.base_url = base_url.rstrip("/")
        self._timeout = timeout_s
        self._retry = retry or RetryPolicy()
        self._http = httpx.Client(base_url=self.base_url, headers=headers, transport=transport)
        self._closed = False

    def close(self) -> None:
        self._closed = True
        self._http.close()

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
                resp = self._http.request(
                    call.method,
                    call.path,
                    params=call.params,
                    content=call.body,
                    timeout=self._timeout + call.extra_timeout,
                )
            except httpx.TransportError as exc:
                if attempt > self._retry.retries or self._closed:
                    raise MetaserverUnavailable(
                        f"{call.method} {self.base_url}{call.path} failed after {attempt} "
                        f"attempts: {exc!r}"
                    ) from exc
            else:
                if resp.status_code < 400:
                    return resp.content
                if not self._retry.retryable_status(resp.status_code) or (
                    attempt > self._retry.retries
                ):
                    raise error_for_status(resp.status_code, resp.content, call.method, call.path)
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

    def put_instance(self, instance_id: str, spec: InstanceSpec) -> Instance:
        return P.decode(Instance, self.send(P.put_instance(instance_id, spec)))

    def get_instance(self, instance_id: str) -> Instance:
        return P.decode(Instance, self.send(P.get_instance(instance_id)))

    def list_instances(self, role: str | None = None) -> list[Instance]:
        return P.decode_list(Instance, "instances", self.send(P.list_instances(role)))

    def delete_instance(self, instance_id: str) -> None:
        self.send(P.delete_instance(instance_id))


Outcome = Callable[[bytes | None, Exception | None], None]


@dataclass(frozen=True, slots=True)
class _Job:
    call: P.Call
    on_done: Outcome | None
    quiet_conflict: bool = False  # a 409 is expected (another process got there first)


_STOP = object()


class BackgroundWriter:
    """Bounded queue + one thread in front of a ``MetaserverClient``. ``submit`` never blocks."""

    def __init__(self, client: MetaserverClient, *, maxsize: int = 4096) -> None:
        self.client = client
        self._queue: queue.Queue[_Job | object] = queue.Queue(maxsize)
        self.dropped = 0
        self.failed = 0
        self.completed = 0
        self._thread = threading.Thread(
            target=self._run, name="pdgate-metaserver-writer", daemon=True
        )
        self._thread.start()

    def submit(
        self, call: P.Call, on_done: Outcome | None = None, quiet_conflict: bool = False
    ) -> bool:
        try:
            self._queue.put_nowait(_Job(call, on_done, quiet_conflict))
        except queue.Full:
            self.dropped += 1
            log.warning("metaserver write queue full; dropped %s %s", call.method, call.path)
            return False
        return True

    def put_binding(
        self, transfer_id: str, spec: BindingSpec, on_done: Outcome | None = None
    ) -> bool:
        return self.submit(P.put_binding(transfer_id, spec), on_done)

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
        return self._queue.qsize()

    def _run(self) -> None:
        while True:
            job = self._queue.get()
            if job is _STOP:
                return
            assert isinstance(job, _Job)
            body: bytes | None = None
            error: Exception | None = None
            try:
                body = self.client.send(job.call)
                self.completed += 1
            except Exception as exc:  # reported to the callback, never raised in this thread
                error = exc
                self.failed += 1
                late = job.quiet_conflict and isinstance(exc, ConflictError)
                log.log(
                    logging.DEBUG if late else logging.WARNING,
                    "metaserver %s %s failed: %s",
                    job.call.method,
                    job.call.path,
                    exc,
                )
            if job.on_done is not None:
                try:
                    job.on_done(body, error)
                except Exception:
                    log.exception("metaserver write callback raised")

    def close(self, timeout_s: float = 5.0) -> None:
        """Finish queued writes (up to ``timeout_s``), stop the thread, close the client."""
        try:
            self._queue.put(_STOP, timeout=timeout_s)
        except queue.Full:
            pass
        self._thread.join(timeout_s)
        self.client.close()
