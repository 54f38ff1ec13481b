"""The attempt loop: per request, attempts until D's first byte is in.

Each attempt asks the selector (``select``) for D, P and the flow, reserves their load, tells
the listeners (``listeners``: shared load, KV placement), and opens the flow once: the flow's
legs run without coming back here. Retries happen only here, i.e. before the first byte reaches
the client: each one re-selects the pair (avoiding the instance that just failed when another is
available), uses a new transfer id, and waits an exponential backoff with full jitter. Failures
are charged to the failing instance's circuit breaker.
"""

from __future__ import annotations

import asyncio
import logging
import weakref
from collections.abc import Sequence
from typing import Any, NamedTuple

from pdwire.client.retry import Backoff
from pdwire.ids import IdMaker
from proxy.backend import LegError
from proxy.config import Flow as FlowName
from proxy.flows import Attempt, Upstream
from proxy.flows.base import FirstSink
from proxy.instances import Instance
from proxy.metrics import Metrics
from proxy.rewrite import ClientRequest
from proxy.routing.listeners import RouteListener
from proxy.routing.select import Selection, Selector
from proxy.tracing import NO_SPAN, RequestSpan

log = logging.getLogger("pdgate.proxy")


class Opened(NamedTuple):
    """A request's answer under way: D's first byte is in. The caller owns ``up`` and must
    ``release`` ``decode`` when the stream ends."""

    up: Upstream
    decode: Instance
    flow: FlowName


class Dispatcher:
    def __init__(
        self,
        selector: Selector,
        listeners: Sequence[RouteListener],
        metrics: Metrics,
        *,
        retries: int,
        backoff: Backoff,
        ids: IdMaker | None = None,
    ) -> None:
        self._selector = selector
        self._listeners = tuple(listeners)
        self._metrics = metrics
        self._retries = retries
        self._backoff = backoff
        self._ids = ids or IdMaker("pd")
        self._ok: weakref.WeakKeyDictionary[Instance, Any] = weakref.WeakKeyDictionary()

    async def open(
        self,
        req: ClientRequest,
        path: str,
        flow: FlowName,
        trace: RequestSpan = NO_SPAN,
        avoiding: frozenset[str] = frozenset(),
        early: FirstSink | None = None,
    ) -> Opened:
        """Run attempts until D's first byte is in. ``trace``: the request's span; each
        attempt's legs become its children. ``avoiding``: instance URLs not to choose while
        others are available. ``early``: where P's first token may go first (every attempt's
        P may offer it; ``proxy.early`` takes one)."""
        info = await self._selector.annotate(req, trace)
        avoid = set(avoiding)
        attempt = 0
        while True:
            for listener in self._listeners:
                await listener.choosing(info)
            sel = self._selector.select(info, flow, avoid)
            d, p = sel.decode, sel.prefill
            a = Attempt(req, info, path, d, p, self._ids.next(), trace, early)
            d.acquire(info.tokens)
            p_load = 0 if p is None else info.uncached(p)  # P's load: the tokens it computes
            if p is not None:  # reserved now, so a burst's later picks already see it
                p.acquire(p_load)
            for listener in self._listeners:
                listener.chosen(sel)
            transfer = self._metrics.transfers.start() if p is not None else None
            try:
                up = await sel.impl.open(a)
            except LegError as exc:
                if transfer is not None:  # not in flight while backing off
                    self._metrics.transfers.end(transfer)
                self._give_back(sel, info.tokens, p_load)
                self._charge(exc, sel)
                give_up = not exc.retryable or attempt >= self._retries
                log.warning(
                    "attempt failed tid=%s engine_request_id=%s flow=%s leg=%s instance=%s "
                    "kind=%s next=%s: %s",
                    a.tid, a.request_id, sel.flow.value, exc.leg, exc.url, exc.kind,
                    "give-up" if give_up else "retry", exc.message,
                )  # fmt: skip
                trace.event(
                    "attempt_failed",
                    {"pdgate.transfer_id": a.tid, "pdgate.leg": exc.leg,
                     "pdgate.kind": exc.kind, "server.address": exc.url},
                )  # fmt: skip
                if give_up:
                    raise
                avoid.add(exc.url)
                attempt += 1
                self._metrics.retries.labels(reason=exc.kind).inc()
                await asyncio.sleep(self._backoff.compute(attempt))  # 1st retry: <= base
                continue
            except BaseException:
                self._give_back(sel, info.tokens, p_load)
                raise
            finally:
                if transfer is not None:
                    self._metrics.transfers.end(transfer)
            if p is not None:
                self.release(p, p_load)  # its leg is over once D's first byte is in
            d.circuit.record(True)
            for listener in self._listeners:
                listener.routed(sel, up)
            self._selector.routed(sel, up)
            self._count_ok(d)
            if p is not None and up.prefill_error is not None:
                self._charge(up.prefill_error, sel)  # D answered alone; P's leg failed
            elif p is not None:
                self._count_ok(p)
            return Opened(up, d, sel.flow)

    def release(self, inst: Instance, tokens: int) -> None:
        """Give back a request's load on ``inst``; the listeners hear of it at once."""
        inst.release(tokens)
        for listener in self._listeners:
            listener.released(inst)

    def _give_back(self, sel: Selection, d_load: int, p_load: int) -> None:
        self.release(sel.decode, d_load)
        if sel.prefill is not None:
            self.release(sel.prefill, p_load)

    def _count_ok(self, inst: Instance) -> None:
        counter = self._ok.get(inst)
        if counter is None:
            counter = self._ok[inst] = self._metrics.instance_requests.labels(
                role=inst.role.value, instance=inst.url, outcome="ok"
            )
        counter.inc()

    def _charge(self, exc: LegError, sel: Selection) -> None:
        for inst in (sel.decode, sel.prefill):
            if inst is not None and inst.url == exc.url:
                if exc.retryable:  # a 4xx is the request's fault, not the instance's
                    inst.circuit.record(False)
                self._metrics.instance_requests.labels(
                    role=inst.role.value, instance=inst.url, outcome=exc.kind
                ).inc()
