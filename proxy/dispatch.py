"""Per request: decide the flow, pick D (and P) by policy, run attempts with retries.

Retries happen only here, i.e. before the first byte reaches the client: each one re-selects
the pair (avoiding the instance that just failed when another is available), uses a new
transfer id, and waits an exponential backoff with full jitter. Failures are charged to the
failing instance's circuit breaker.
"""

from __future__ import annotations

import asyncio
import logging
import weakref
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from pdwire.client.retry import Backoff
from pdwire.ids import IdMaker
from proxy.backend import LegError
from proxy.config import Flow as FlowName
from proxy.errors import BadRequest, NoInstance
from proxy.flows import Attempt, Flow, Upstream
from proxy.instances import Instance, Registry, Role, unpairable
from proxy.instances.share import LoadSync, NoSharing
from proxy.integrity import PairGuard
from proxy.metrics import Metrics
from proxy.policies import Policy, RequestInfo
from proxy.policies.prefix import PrefixAware
from proxy.rewrite import ClientRequest
from proxy.tracing import NO_SPAN

if TYPE_CHECKING:
    from proxy.kvroute.lookup import KVLookup
    from proxy.tracing import RequestSpan

log = logging.getLogger("pdgate.proxy")


class Decider:
    """Disaggregate, or let D compute the prompt (short prompt, or D likely has it cached)."""

    def __init__(
        self, min_tokens: int, cached_ratio: float, prefix: PrefixAware | None, metrics: Metrics
    ) -> None:
        self._min_tokens = min_tokens
        self._ratio = cached_ratio
        self._prefix = prefix
        self._counts = {
            name: metrics.decisions.labels(decision=name)
            for name in ("disaggregate", "short_prompt", "cached", "direct")
        }

    def _cached_share(self, info: RequestInfo, d: Instance) -> float:
        """The share of the prompt's blocks D holds: by the KV-event index when the request
        was matched against it, else by what the ``prefix`` policy sent D."""
        if info.kv is not None:
            m = info.kv.get(d.url)
            return m.blocks / m.of if m is not None and m.of else 0.0
        if self._prefix is not None and info.hashes:
            return self._prefix.matched_blocks(d, info) / len(info.hashes)
        return 0.0

    def decide(self, flow: FlowName, info: RequestInfo, d: Instance) -> FlowName:
        if flow == FlowName.DIRECT:
            self._counts["direct"].inc()
            return flow
        if self._min_tokens and info.tokens < self._min_tokens:
            self._counts["short_prompt"].inc()
            return FlowName.DIRECT
        if self._ratio and self._cached_share(info, d) >= self._ratio:
            self._counts["cached"].inc()
            return FlowName.DIRECT
        self._counts["disaggregate"].inc()
        return flow


def pairs(p: Instance, d: Instance, guard: PairGuard | None = None) -> bool:
    """Whether P may push into D: by their registrations (revision, KV identity, TP; an
    instance the registry does not describe is not held back), and not quarantined after
    their first tokens differed."""
    if guard is not None and guard.blocked(p, d):
        return False
    return unpairable(p, d) is None


class Dispatcher:
    def __init__(
        self,
        registry: Registry,
        flows: Mapping[FlowName, Flow],
        prefill_policy: Policy,
        decode_policy: Policy,
        decider: Decider,
        metrics: Metrics,
        *,
        retries: int,
        backoff: Backoff,
        ids: IdMaker | None = None,
        guard: PairGuard | None = None,
        kv: KVLookup | None = None,
        share: LoadSync | None = None,
    ) -> None:
        self._registry = registry
        self._flows = flows
        self._p_policy = prefill_policy
        self._d_policy = decode_policy
        self._decider = decider
        self._metrics = metrics
        self._retries = retries
        self._backoff = backoff
        self._ids = ids or IdMaker("pd")
        self._guard = guard
        self._kv = kv  # KV-event routing: each request matched against the index first
        self._share = share or NoSharing()  # --share-load: the other replicas' load
        self._ok: weakref.WeakKeyDictionary[Instance, Any] = weakref.WeakKeyDictionary()
        self._told: set[tuple[str, str, str]] = set()  # (P, D, reason): logged once per pair

    def _pick(
        self,
        role: Role,
        avoid: set[str],
        info: RequestInfo,
        policy: Policy,
        pairs_with: Instance | None = None,
    ) -> Instance | None:
        """``role``'s instance for this attempt; with ``pairs_with`` (D), only a P that may
        push into it (``None``: every available P is incompatible with D)."""
        candidates = self._registry.available(role, frozenset(avoid)) if avoid else None
        if not candidates:
            candidates = self._registry.available(role)
        if not candidates:
            candidates = self._registry.panic(role)
            if candidates:
                self._metrics.decisions.labels(decision=f"panic_{role.value}").inc()
        if not candidates:
            raise NoInstance(f"no {role.value} instance available", retry_after=1)
        if pairs_with is not None:
            candidates = [c for c in candidates if self._pairs(c, pairs_with)]
            if not candidates:
                return None
        return policy.choose(candidates, info)

    async def open(
        self,
        req: ClientRequest,
        path: str,
        flow: FlowName,
        trace: RequestSpan = NO_SPAN,
        avoiding: frozenset[str] = frozenset(),
    ) -> tuple[Upstream, Instance, FlowName]:
        """Run attempts until D's first byte is in. The caller owns ``Upstream`` and must
        ``release`` the returned instance when the stream ends. ``trace``: the
        request's span; each attempt's legs become its children. ``avoiding``:
        instance URLs not to choose while others are available."""

        info = RequestInfo(req.prompt, req.tokens)
        if self._kv is not None:
            await self._annotate(info, req, trace)
        avoid = set(avoiding)
        attempt = 0
        while True:
            await self._share.fresh()
            d = self._pick(Role.DECODE, avoid, info, self._d_policy)
            assert d is not None
            chosen = self._decider.decide(flow, info, d)
            impl = self._flows.get(chosen)
            if impl is None:
                raise BadRequest(f"flow {chosen.value} is not available (no --metaserver)")
            p = None
            if impl.needs_prefill:
                p = self._pick(Role.PREFILL, avoid, info, self._p_policy, pairs_with=d)
                if p is None:  # no P of D's revision / KV identity, or quarantined: D computes
                    self._metrics.decisions.labels(decision="no_compatible_prefill").inc()
                    log.debug("no prefill instance can push into %s; D computes", d.id)
                    chosen, impl = FlowName.DIRECT, self._flows[FlowName.DIRECT]
            if self._kv is not None and info.kv is not None:  # every replica's index knows
                self._kv.placed(d, info)
                if p is not None:
                    self._kv.placed(p, info)
            a = Attempt(req, info, path, d, p, self._ids.next(), trace)
            d.acquire(info.tokens)
            p_load = 0 if p is None else info.uncached(p)  # P's load: the tokens it computes
            if p is not None:  # reserved now, so a burst's later picks already see it
                p.acquire(p_load)
            self._share.changed()  # the other replicas' next choices see it
            transfer = self._metrics.transfers.start() if p is not None else None
            try:
                up = await impl.open(a)
            except LegError as exc:
                if transfer is not None:  # not in flight while backing off
                    self._metrics.transfers.end(transfer)
                self.release(d, info.tokens)
                if p is not None:
                    self.release(p, p_load)
                self._charge(exc, d, p)
                give_up = not exc.retryable or attempt >= self._retries
                log.warning(
                    "attempt failed tid=%s engine_request_id=%s flow=%s leg=%s instance=%s "
                    "kind=%s next=%s: %s",
                    a.tid, a.request_id, chosen.value, exc.leg, exc.url, exc.kind,
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
                self.release(d, info.tokens)
                if p is not None:
                    self.release(p, p_load)
                raise
            finally:
                if transfer is not None:
                    self._metrics.transfers.end(transfer)
            if p is not None:
                self.release(p, p_load)  # its leg is over once D's first byte is in
            d.circuit.record(True)
            if info.kv is not None:  # the decision, for the binding's first_token mark
                up.kv_held = {m.instance_id: m.blocks for m in info.kv.values()}
            self._d_policy.on_routed(d, info)
            self._count_ok(d)
            if p is not None and up.prefill_error is not None:
                self._charge(up.prefill_error, d, p)  # D answered alone; P's leg failed
            elif p is not None:
                self._p_policy.on_routed(p, info)
                self._count_ok(p)
            return up, d, chosen

    def release(self, inst: Instance, tokens: int) -> None:
        """Give back a request's load on ``inst``; the other replicas hear of it at once."""
        inst.release(tokens)
        self._share.changed()

    async def _annotate(self, info: RequestInfo, req: ClientRequest, trace: RequestSpan) -> None:
        assert self._kv is not None
        reg = self._registry
        instances = [*reg.available(Role.PREFILL), *reg.available(Role.DECODE)]
        await self._kv.annotate(info, req.body, req.chat, instances)
        req.tokens = info.tokens  # exact once tokenized; D's load is released by this count
        if trace.recording and info.kv is not None:
            trace.event(
                "kv_match",
                {"pdgate.prompt_tokens": info.tokens,
                 "pdgate.kv.matched": " ".join(
                     f"{url}={m.blocks}/{m.of}" for url, m in info.kv.items())},
            )  # fmt: skip

    def _pairs(self, p: Instance, d: Instance) -> bool:
        """``pairs``, with each registered pair that cannot push logged once (the metric
        ``pd_pair_unpairable`` shows them all at scrape time)."""
        problem = unpairable(p, d)
        if problem is not None:
            key = (p.url, d.url, problem.reason)
            if key not in self._told:
                self._told.add(key)
                log.warning(
                    "prefill %s is never paired with decode %s (%s): %s",
                    p.id, d.id, problem.reason, problem.text,
                )  # fmt: skip
            return False
        return self._guard is None or not self._guard.blocked(p, d)

    def _count_ok(self, inst: Instance) -> None:
        counter = self._ok.get(inst)
        if counter is None:
            counter = self._ok[inst] = self._metrics.instance_requests.labels(
                role=inst.role.value, instance=inst.url, outcome="ok"
            )
        counter.inc()

    def _charge(self, exc: LegError, d: Instance, p: Instance | None) -> None:
        for inst in (d, p):
            if inst is not None and inst.url == exc.url:
                if exc.retryable:  # a 4xx is the request's fault, not the instance's
                    inst.circuit.record(False)
                self._metrics.instance_requests.labels(
                    role=inst.role.value, instance=inst.url, outcome=exc.kind
                ).inc()
