"""Per attempt, once D is chosen: disaggregate, or let D compute the prompt itself (a short
prompt, or one D likely holds already: ``--disagg-min-tokens``, ``--cached-skip-ratio``)."""

from __future__ import annotations

from proxy.config import Flow as FlowName
from proxy.instances import Instance
from proxy.metrics import Metrics
from proxy.policies import RequestInfo
from proxy.policies.prefix import PrefixAware


class Decider:
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
