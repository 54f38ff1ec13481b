"""What every flow shares: the attempt it runs, the upstream it returns, the two leg helpers."""

from __future__ import annotations

import os
import time
from typing import TYPE_CHECKING, Any, Protocol

import msgspec

from pdwire.ids import RANDOM_BYTES
from pdwire.params import parse_push_report
from proxy.backend import Backend, LegError, Response
from proxy.errors import UpstreamError, UpstreamTimeout
from proxy.instances import Instance
from proxy.integrity import (
    PairGuard,
    PrefillChoice,
    Verdict,
    answer_first,
    describe,
    judge,
    judged,
    prefill_first,
    stream_first,
)
from proxy.metrics import Metrics
from proxy.policies import RequestInfo
from proxy.rewrite import ClientRequest, cached_tokens_of
from proxy.tracing import NO_SPAN

if TYPE_CHECKING:
    from proxy.tracing import LegSpan, RequestSpan


class Timeouts:
    __slots__ = ("binding_wait", "first_token", "prefill", "prefill_grace", "request")

    def __init__(
        self,
        prefill: float,
        binding_wait: float,
        first_token: float,
        request: float,
        prefill_grace: float = 2.0,
    ):
        self.prefill = prefill
        self.binding_wait = binding_wait
        self.first_token = first_token
        self.request = request
        self.prefill_grace = prefill_grace  # P's answer awaited this long once D answered


class Attempt:
    """One try of one client request: a fresh transfer id, a chosen D (and P)."""

    __slots__ = (
        "decode", "early", "info", "path", "prefill", "req", "request_id", "tid", "trace",
    )  # fmt: skip

    def __init__(
        self,
        req: ClientRequest,
        info: RequestInfo,
        path: str,
        decode: Instance,
        prefill: Instance | None,
        tid: str,
        trace: RequestSpan = NO_SPAN,
        early: FirstSink | None = None,
    ) -> None:
        self.req = req
        self.info = info
        self.path = path
        self.decode = decode
        self.prefill = prefill
        self.tid = tid
        # the X-Request-Id P and D are sent (their logs share it): it names D's answer (its
        # ``id``), which the client sees, so it is not the transfer id, which would let a
        # client name its transfer (a flow whose engines key transfers by it sets it so)
        self.request_id = f"pdr-{os.urandom(RANDOM_BYTES).hex()}"
        self.trace = trace  # the request's span (``NO_SPAN``: tracing off)
        self.early = early  # where P's first token may go before D's (``proxy.early``)

    def decode_body(self, kv: dict[str, Any] | msgspec.Raw | None) -> bytes:
        """The request for D (``kv``: its ``kv_transfer_params``), in D's cache epoch."""
        return self.req.for_decode(kv, self.decode.cache_epoch)

    def leg_span(self, leg: str, url: str) -> LegSpan:
        """A child span of the request for one leg of this attempt."""
        trace = self.trace
        if not trace.recording:  # tracing off: no attributes to build
            return NO_SPAN
        return trace.leg(leg, {"pdgate.transfer_id": self.tid, "server.address": url})


class Upstream:
    """D's answer with its first bytes read (the whole body when not streaming)."""

    __slots__ = (
        "binding_ids",
        "binding_tracked",
        "chunks",
        "first",
        "kv_held",
        "prefill_cached",
        "prefill_error",
        "resp",
        "tid",
    )

    def __init__(self, resp: Response, first: bytes, tid: str) -> None:
        self.resp = resp
        self.first = first
        self.tid = tid
        self.prefill_cached: int | None = None
        self.binding_tracked = False  # decode-first flows: the metaserver knows this tid
        self.binding_ids: tuple[str, ...] = ()  # the bindings' ids when not just ``tid``
        # P's leg failed and D answered alone: the dispatcher charges P for it
        self.prefill_error: LegError | None = None
        self.kv_held: dict[str, int] | None = None  # kv policy: each candidate's hits, by id
        self.chunks = 0  # of a streamed answer, relayed so far, the first included

    @property
    def content_type(self) -> bytes:
        return self.resp.content_type

    def close(self) -> None:
        """Drop the connection (an unfinished D request is aborted by vLLM)."""
        self.resp.close()

    def release(self) -> None:
        self.resp.release()


class FirstSink(Protocol):
    async def offer(self, answer: PrefillAnswer) -> None:
        """P answered before D's first token: the client may have P's first token now."""
        ...


class Flow(Protocol):
    name: str
    needs_prefill: bool

    async def open(self, a: Attempt) -> Upstream: ...


class PrefillAnswer(msgspec.Struct):
    """What the proxy reads from P's answer; everything else is skipped unparsed."""

    id: Any = None
    created: Any = None
    model: Any = None
    kv_transfer_params: msgspec.Raw = msgspec.Raw()  # empty when absent
    usage: Any = None
    choices: list[PrefillChoice] | None = None  # P's one token (``proxy.integrity``)


_prefill_answer = msgspec.json.Decoder(PrefillAnswer)


def no_push_reason(answer: PrefillAnswer) -> str | None:
    """Why P set up no push to D, when its connector says it did not; else ``None``."""
    report = parse_push_report(bytes(answer.kv_transfer_params))
    return None if report is None else report.no_push_reason


class Legs:
    """The two leg primitives, shared by the flows, and the first-token check between them."""

    def __init__(
        self,
        backend: Backend,
        timeouts: Timeouts,
        metrics: Metrics,
        guard: PairGuard | None = None,
    ) -> None:
        self.backend = backend
        self.timeouts = timeouts
        self.metrics = metrics
        self.guard = guard  # None: first tokens are not compared
        self._ttft = metrics.decode_ttft_seconds
        self._prefill_s = metrics.prefill_seconds

    async def decode(self, a: Attempt, body: bytes, span: LegSpan) -> Upstream:
        """D's leg up to its first byte (its whole answer when not streaming), in ``span``
        (sent to D as ``traceparent``, ended here)."""
        d = a.decode
        t0 = time.perf_counter()
        stream = a.req.stream
        limit = self.timeouts.first_token if stream else self.timeouts.request
        try:
            resp = await self.backend.post(
                d.url, a.path, body, a.request_id, "decode", limit, span.traceparent
            )
            try:
                if stream:
                    first = await resp.next_chunk(limit - (time.perf_counter() - t0))
                else:
                    first = await resp.read(limit - (time.perf_counter() - t0))
            except UpstreamTimeout as exc:
                resp.close()
                err = UpstreamTimeout(f"no first byte in {limit}s")
                raise LegError(err, d.url, "decode") from exc
            except UpstreamError as exc:
                resp.close()
                raise LegError(exc, d.url, "decode") from exc
            except BaseException:
                resp.close()
                raise
            if not first:
                resp.close()
                raise LegError(UpstreamError("empty answer"), d.url, "decode")
        except BaseException as exc:
            span.end(exc)
            raise
        span.end()
        self._ttft.observe(time.perf_counter() - t0)
        return Upstream(resp, first, a.tid)

    async def prefill(self, a: Attempt, kv: dict[str, Any], span: LegSpan) -> PrefillAnswer:
        """P's whole answer, in ``span``, whose ``traceparent`` the caller put in ``kv``: sent
        to P as that header too, ended here with P's push report."""
        p = a.prefill
        assert p is not None
        limit = self.timeouts.prefill
        t0 = time.perf_counter()  # P's load is held by the dispatcher for the whole attempt
        # a judged request's first token is compared by id when D's answer shows it (and is
        # the client's first, before D's, when ``a.early`` takes it)
        token_ids = (self.guard is not None or a.early is not None) and judged(a.req.body)
        try:
            body = a.req.for_prefill(kv, token_ids)
            resp = await self.backend.post(
                p.url, a.path, body, a.request_id, "prefill", limit, span.traceparent
            )
            try:
                raw = await resp.read(limit - (time.perf_counter() - t0))
            except UpstreamError as exc:
                resp.close()
                raise LegError(exc, p.url, "prefill") from exc
            except BaseException:
                resp.close()
                raise
            resp.release()
            try:
                out = _prefill_answer.decode(raw)
            except msgspec.DecodeError as exc:
                err = UpstreamError("answer is not a JSON object")
                raise LegError(err, p.url, "prefill") from exc
        except BaseException as exc:
            span.end(exc)
            raise
        if span.recording:
            _annotate_prefill(span, out)
        span.end()
        self._prefill_s.observe(time.perf_counter() - t0)
        p.circuit.record(True)
        return out

    async def first_tokens_differ(
        self, a: Attempt, answer: PrefillAnswer, up: Upstream
    ) -> str | None:
        """Compare P's first token with D's (greedy requests, ``proxy.integrity``); on a
        mismatch the pair is quarantined and the reason returned: the caller drops ``up`` and
        has D compute the prompt. D's chunks read meanwhile stay in ``up.first``."""
        guard = self.guard
        if guard is None or a.prefill is None or not judged(a.req.body):
            return None
        chat = a.req.chat
        p_first = prefill_first(answer.choices, chat)
        if p_first.token_id is None and (not p_first.text or "\ufffd" in p_first.text):
            guard.record(Verdict.UNJUDGED, a.prefill, a.decode, a.tid)
            return None
        if a.req.stream:
            idle = self.timeouts.first_token
            try:
                up.first, d_first = await stream_first(
                    up.first, lambda: up.resp.next_chunk(idle), chat, p_first
                )
            except UpstreamError as exc:
                up.close()
                err = UpstreamError(f"reading D's first content: {exc.message}")
                raise LegError(err, a.decode.url, "decode") from exc
            except BaseException:  # cancelled (the client left): nobody else closes it
                up.close()
                raise
        else:
            d_first = answer_first(up.first, chat)
        verdict = judge(p_first, d_first)
        seen = describe(p_first, d_first)
        guard.record(verdict, a.prefill, a.decode, a.tid, seen)
        return f"first tokens differ: {seen}" if verdict is Verdict.MISMATCH else None


def prefill_cached(answer: PrefillAnswer) -> int | None:
    return cached_tokens_of(answer.usage)


def _annotate_prefill(span: LegSpan, answer: PrefillAnswer) -> None:
    """P's push report and cached tokens on its leg's span."""
    report = parse_push_report(bytes(answer.kv_transfer_params))
    if report is not None and report.push:
        span.set("pdgate.push", report.push)
        if report.no_push_reason is not None:
            span.set("pdgate.no_push_reason", report.no_push_reason)
    cached = prefill_cached(answer)
    if cached is not None:
        span.set("pdgate.prefill_cached_tokens", cached)
