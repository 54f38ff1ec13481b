"""The selector: what one attempt goes to. Once per request it annotates what the policies may
look at (``annotate``: the prompt's tokens and, with KV-event routing, each candidate's cache
hits); per attempt it picks D, decides the flow, and picks a P that may push into D (``select``
→ a ``Selection``). It holds no load and sends nothing: the attempt loop (``attempts``) does."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Protocol

from proxy.config import Flow as FlowName
from proxy.errors import BadRequest, NoInstance
from proxy.flows import Flow, Upstream
from proxy.instances import Instance, Registry, Role
from proxy.metrics import Metrics
from proxy.policies import Policy, RequestInfo
from proxy.rewrite import ClientRequest
from proxy.routing.decide import Decider
from proxy.routing.pairing import Pairing
from proxy.tracing import RequestSpan

log = logging.getLogger("pdgate.proxy")


@dataclass(frozen=True, slots=True)
class Policies:
    prefill: Policy
    decode: Policy


@dataclass(frozen=True, slots=True)
class Selection:
    """One attempt's choice: D, P (``None``: D computes the prompt) and the flow that runs."""

    info: RequestInfo
    decode: Instance
    prefill: Instance | None
    flow: FlowName
    impl: Flow


class Annotator(Protocol):
    async def annotate(self, info: RequestInfo, req: ClientRequest, trace: RequestSpan) -> None:
        """Add what the policies may use to ``info`` (and set ``req.tokens`` if it learns the
        exact count); never raises."""
        ...


class NoAnnotation:
    async def annotate(self, info: RequestInfo, req: ClientRequest, trace: RequestSpan) -> None:
        return None


NO_ANNOTATION = NoAnnotation()


class Selector:
    def __init__(
        self,
        registry: Registry,
        flows: Mapping[FlowName, Flow],
        policies: Policies,
        decider: Decider,
        pairing: Pairing,
        metrics: Metrics,
        annotator: Annotator = NO_ANNOTATION,
    ) -> None:
        self._registry = registry
        self._flows = flows
        self._policies = policies
        self._decider = decider
        self._pairing = pairing
        self._metrics = metrics
        self._annotator = annotator

    async def annotate(self, req: ClientRequest, trace: RequestSpan) -> RequestInfo:
        info = RequestInfo(req.prompt, req.tokens)
        await self._annotator.annotate(info, req, trace)
        return info

    def select(self, info: RequestInfo, flow: FlowName, avoid: set[str]) -> Selection:
        d = self._pick(Role.DECODE, avoid, info, self._policies.decode)
        assert d is not None
        chosen = self._decider.decide(flow, info, d)
        impl = self._flows.get(chosen)
        if impl is None:
            raise BadRequest(f"flow {chosen.value} is not available (no --metaserver)")
        p = None
        if impl.needs_prefill:
            p = self._pick(Role.PREFILL, avoid, info, self._policies.prefill, pairs_with=d)
            if p is None:  # no P of D's revision / KV identity, or quarantined: D computes
                self._metrics.decisions.labels(decision="no_compatible_prefill").inc()
                log.debug("no prefill instance can push into %s; D computes", d.id)
                chosen, impl = FlowName.DIRECT, self._flows[FlowName.DIRECT]
        return Selection(info, d, p, chosen, impl)

    def routed(self, sel: Selection, up: Upstream) -> None:
        """D's first byte is in: the policies with a memory learn where the request went (not
        P when its leg failed and D answered alone)."""
        self._policies.decode.on_routed(sel.decode, sel.info)
        if sel.prefill is not None and up.prefill_error is None:
            self._policies.prefill.on_routed(sel.prefill, sel.info)

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
            candidates = [c for c in candidates if self._pairing.allows(c, pairs_with)]
            if not candidates:
                return None
        return policy.choose(candidates, info)
