"""Blocking metaserver client (the connector's threads; ``pdwire.client.writer`` puts a
fire-and-forget queue in front of it)."""

from __future__ import annotations

import time
from types import TracebackType

import httpx

from pdwire.client import _protocol as P
from pdwire.client.errors import (
    MetaserverUnavailable,
    NotFoundError,
    error_for_status,
)
from pdwire.client.exchange import Exchange, ExchangeError, Headers, HttpxExchange, PlainExchange
from pdwire.client.retry import RetryPolicy
from pdwire.client.token import Token, token_of
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


class MetaserverClient:
    def __init__(
        self,
        base_url: str,
        *,
        token: Token = None,
        timeout_s: float = 5.0,
        retry: RetryPolicy | None = None,
        transport: httpx.BaseTransport | None = None,
    ) -> None:
        """``token``: a string, or a callable asked before each call (``FileToken``: a file
        re-read when it changes). ``transport``: serve the calls through httpx with it (tests);
        by default they go through ``PlainExchange`` (pdwire/client/exchange.py: why)."""
        self.base_url = base_url.rstrip("/")
        self._timeout = timeout_s
        self._retry = retry or RetryPolicy()
        headers: Headers = (
            (lambda: P.headers(token_of(token))) if callable(token) else P.headers(token)
        )
        self._exchange: Exchange = (
            PlainExchange(self.base_url, headers)
            if transport is None
            else HttpxExchange(self.base_url, headers, transport)
        )
        self._closed = False

    @property
    def retry(self) -> RetryPolicy:
        return self._retry

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
