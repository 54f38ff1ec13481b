"""Async metaserver client (aiohttp: it sits on the proxy's data path).

One pooled ``aiohttp.ClientSession`` per client; pass your own to share a pool. Every call has a
timeout; connection errors, timeouts and 5xx are retried with backoff + jitter; 4xx raise the
typed errors of ``pdwire.client.errors`` at once.
"""

from __future__ import annotations

import asyncio
import copy
from collections.abc import Sequence
from types import TracebackType

import aiohttp

from pdwire.client import _protocol as P
from pdwire.client.errors import MetaserverUnavailable, NotFoundError, error_for_status
from pdwire.client.retry import RetryPolicy
from pdwire.client.token import Token
from pdwire.models import (
    Binding,
    BindingSpec,
    BindingState,
    EventDetail,
    Instance,
    InstanceSpec,
    KVMatchOut,
    LoadReport,
    LoadView,
    MarkDetail,
    MarkKind,
    Stats,
)


class AsyncMetaserverClient:
    def __init__(
        self,
        base_url: str,
        *,
        token: Token = None,
        timeout_s: float = 5.0,
        retry: RetryPolicy | None = None,
        session: aiohttp.ClientSession | None = None,
        max_connections: int = 256,
    ) -> None:
        self.base_url = base_url.rstrip("/")
        self._timeout = timeout_s
        self._retry = retry or RetryPolicy()
        self._token = token if callable(token) else None  # asked before each call
        self._headers = P.headers(None if callable(token) else token)
        self._own_session = session is None
        self._session = session
        self._max_connections = max_connections

    def _get_session(self) -> aiohttp.ClientSession:
        if self._session is None:
            connector = aiohttp.TCPConnector(limit=self._max_connections, ttl_dns_cache=300)
            self._session = aiohttp.ClientSession(connector=connector)
        return self._session

    def with_policy(self, *, timeout_s: float, retry: RetryPolicy) -> AsyncMetaserverClient:
        """This client — its session, credentials and address — with another timeout and
        retry policy for the calls made through what it returns (closing that closes
        nothing): one client per process, each caller's calls as patient as they need."""
        view = copy.copy(self)
        view._session = self._get_session()
        view._own_session = False
        view._timeout = timeout_s
        view._retry = retry
        return view

    def _fresh_headers(self) -> dict[str, str]:
        assert self._token is not None
        return P.headers(self._token())

    async def close(self) -> None:
        if self._own_session and self._session is not None:
            await self._session.close()
            self._session = None

    async def __aenter__(self) -> AsyncMetaserverClient:
        return self

    async def __aexit__(
        self, t: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.close()

    async def send(self, call: P.Call) -> bytes:
        """Perform one call with retries; return the body of a 2xx answer."""
        session = self._get_session()
        url = self.base_url + call.path
        timeout = aiohttp.ClientTimeout(total=self._timeout + call.extra_timeout)
        attempt = 0
        while True:
            attempt += 1
            try:
                async with session.request(
                    call.method,
                    url,
                    params=call.params,
                    data=call.body,
                    headers=self._headers if self._token is None else self._fresh_headers(),
                    timeout=timeout,
                ) as resp:
                    body = await resp.read()
                    status = resp.status
            except (aiohttp.ClientError, TimeoutError) as exc:
                if attempt > self._retry.retries:
                    raise MetaserverUnavailable(
                        f"{call.method} {url} failed after {attempt} attempts: {exc!r}"
                    ) from exc
            else:
                if status < 400:
                    return body
                if not self._retry.retryable_status(status) or attempt > self._retry.retries:
                    raise error_for_status(status, body, call.method, call.path)
            await asyncio.sleep(self._retry.backoff.compute(attempt))

    # ---- bindings -------------------------------------------------------------------------
    async def put_binding(self, transfer_id: str, spec: BindingSpec) -> Binding:
        return P.decode(Binding, await self.send(P.put_binding(transfer_id, spec)))

    async def get_binding(
        self, transfer_id: str, *, wait: float | None = None, state: BindingState | None = None
    ) -> Binding:
        """Read a binding. With ``wait``, long-poll until it exists (or reaches ``state``);
        raises ``NotFoundError`` if it still does not exist; on a wait that timed out with the
        binding present, returns it as it is (check ``.state``)."""
        return P.decode(Binding, await self.send(P.get_binding(transfer_id, wait, state)))

    async def find_binding(self, transfer_id: str) -> Binding | None:
        try:
            return await self.get_binding(transfer_id)
        except NotFoundError:
            return None

    async def delete_binding(self, transfer_id: str) -> None:
        await self.send(P.delete_binding(transfer_id))

    async def list_bindings(
        self, *, state: BindingState | None = None, instance: str | None = None, limit: int = 100
    ) -> list[Binding]:
        body = await self.send(P.list_bindings(state, instance, limit))
        return P.decode_list(Binding, "bindings", body)

    async def post_event(
        self, transfer_id: str, state: BindingState, actor: str, detail: EventDetail | None = None
    ) -> Binding:
        return P.decode(Binding, await self.send(P.post_event(transfer_id, state, actor, detail)))

    async def post_mark(
        self, transfer_id: str, mark: MarkKind, actor: str, detail: MarkDetail | None = None
    ) -> None:
        """Record a moment that is not a state (``first_token``, ``end``); once per kind.
        Answered ``204``: nothing to decode."""
        await self.send(P.post_mark(transfer_id, mark, actor, detail))

    # ---- instances ------------------------------------------------------------------------
    async def put_instance(self, instance_id: str, spec: InstanceSpec) -> Instance:
        return P.decode(Instance, await self.send(P.put_instance(instance_id, spec)))

    async def get_instance(self, instance_id: str) -> Instance:
        return P.decode(Instance, await self.send(P.get_instance(instance_id)))

    async def list_instances(self, role: str | None = None) -> list[Instance]:
        return P.decode_list(Instance, "instances", await self.send(P.list_instances(role)))

    async def delete_instance(self, instance_id: str) -> None:
        await self.send(P.delete_instance(instance_id))

    async def set_draining(self, instance_id: str, draining: bool = True) -> Instance:
        """Drain (or undrain) a registered instance; ``NotFoundError`` if it is not."""
        return P.decode(Instance, await self.send(P.drain_instance(instance_id, draining)))

    # ---- routing --------------------------------------------------------------------------
    async def kv_match(self, keys: Sequence[int], instances: Sequence[str]) -> dict[str, int]:
        """Per instance, how many of ``keys`` (a prompt's block keys) its cache holds."""
        return P.decode(KVMatchOut, await self.send(P.kv_match(keys, instances))).matched

    async def kv_placed(self, placed: Sequence[tuple[str, Sequence[int]]]) -> None:
        """Tell the index where prompts just went: ``(instance id, block keys)`` each."""
        await self.send(P.kv_placed(placed))

    async def share_load(self, replica: str, report: LoadReport) -> LoadView:
        """Report this proxy replica's load; the other replicas' comes back."""
        return P.decode(LoadView, await self.send(P.share_load(replica, report)))

    async def view_load(self, replica: str) -> LoadView:
        """The other replicas' load, reporting nothing."""
        return P.decode(LoadView, await self.send(P.view_load(replica)))

    # ---- operations -----------------------------------------------------------------------
    async def stats(self) -> Stats:
        return P.decode(Stats, await self.send(P.STATS))

    async def ready(self) -> bool:
        try:
            await self.send(P.READY)
        except (MetaserverUnavailable, Exception):
            return False
        return True
