"""What every flow shares: the attempt it runs, the upstream it returns, the two leg helpers."""

from __future__ import annotations

import asyncio
import time
from typing import Any, Protocol

import aiohttp

from proxy.backend import Backend, LegError
from proxy.errors import UpstreamError, UpstreamTimeout
from proxy.instances import Instance
from proxy.metrics import Metrics
from proxy.policies import RequestInfo
from proxy.rewrite import ClientRequest, cached_tokens_of


class Timeouts:
    __slots__ = ("binding_wait", "first_token", "prefill", "request")

    def __init__(self, prefill: float, binding_wait: float, first_token: float, request: float):
        self.prefill = prefill
        self.binding_wait = binding_wait
        self.first_token = first_token
        self.request = request


class Attempt:
    """One try of one client request: a fresh transfer id, a chosen D (and P)."""

    __slots__ = ("decode", "info", "path", "prefill", "req", "tid")

    def __init__(
        self,
        req: ClientRequest,
        info: RequestInfo,
        path: str,
        decode: Instance,
        prefill: Instance | None,
        tid: str,
    ) -> None:
        self.req = req
        self.info = info
        self.path = path
        self.decode = decode
        self.prefill = prefill
        self.tid = tid


class Upstream:
    """D's answer with its first bytes read (the whole body when not streaming)."""

    __slots__ = ("binding_tracked", "first", "prefill_cached", "resp", "tid")

    def __init__(self, resp: aiohttp.ClientResponse, first: bytes, tid: str) -> None:
        self.resp = resp
        self.first = first
        self.tid = tid
        self.prefill_cached: int | None = None
        self.binding_tracked = False  # decode-first flows: the metaserver knows this tid

    @property
    def content_type(self) -> bytes:
        return self.resp.headers.get("content-type", "application/json").encode()

    def close(self) -> None:
        """Drop the connection (an unfinished D request is aborted by vLLM)."""
        self.resp.close()

    def release(self) -> None:
        self.resp.release()


class Flow(Protocol):
    name: str
    needs_prefill: bool

    async def open(self, a: Attempt) -> Upstream: ...


class Legs:
    """The two leg primitives, shared by the flows."""

    def __init__(self, backend: Backend, timeouts: Timeouts, metrics: Metrics) -> None:
        self.backend = backend
        self.timeouts = timeouts
        self.metrics = metrics

    async def decode(self, a: Attempt, body: bytes) -> Upstream:
        d = a.decode
        t0 = time.perf_counter()
        limit = self.timeouts.first_token if a.req.stream else self.timeouts.request
        resp: aiohttp.ClientResponse | None = None
        try:
            async with asyncio.timeout(limit):
                resp = await self.backend.open(d.url, a.path, body, a.tid, "decode")
                first = await (resp.content.readany() if a.req.stream else resp.read())
        except TimeoutError as exc:
            if resp is not None:
                resp.close()
            raise LegError(UpstreamTimeout(f"no first byte in {limit}s"), d.url, "decode") from exc
        except aiohttp.ClientError as exc:
            if resp is not None:
                resp.close()
            raise LegError(UpstreamError(f"broken answer: {exc!r}"), d.url, "decode") from exc
        except BaseException:
            if resp is not None:
                resp.close()
            raise
        if not first:
            resp.close()
            raise LegError(UpstreamError("empty answer"), d.url, "decode")
        self.metrics.decode_ttft_seconds.observe(time.perf_counter() - t0)
        return Upstream(resp, first, a.tid)

    async def prefill(self, a: Attempt, kv: dict[str, Any]) -> dict[str, Any]:
        p = a.prefill
        assert p is not None
        tokens = a.info.tokens
        p.acquire(tokens)
        t0 = time.perf_counter()
        try:
            out = await self.backend.call_json(
                p.url, a.path, a.req.for_prefill(kv), a.tid, "prefill", self.timeouts.prefill
            )
        finally:
            p.release(tokens)
        self.metrics.prefill_seconds.observe(time.perf_counter() - t0)
        p.circuit.record(True)
        return out


def prefill_cached(answer: dict[str, Any]) -> int | None:
    return cached_tokens_of(answer.get("usage"))
