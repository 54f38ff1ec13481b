"""least_load: fewest in-flight requests, then fewest estimated tokens in flight."""

from __future__ import annotations

from collections.abc import Sequence

from proxy.instances import Instance
from proxy.policies.base import RequestInfo


def load_key(inst: Instance) -> tuple[int, int]:
    return (inst.inflight, inst.tokens)


class LeastLoad:
    name = "least_load"

    def choose(self, candidates: Sequence[Instance], req: RequestInfo) -> Instance:
        if len(candidates) == 1:
            return candidates[0]
        return min(candidates, key=load_key)

    def on_routed(self, inst: Instance, req: RequestInfo) -> None:
        pass
