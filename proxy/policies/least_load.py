"""least_load: fewest in-flight requests, then fewest estimated tokens in flight (every proxy
replica's with ``--share-load``)."""

from __future__ import annotations

from collections.abc import Sequence

from proxy.instances import Instance
from proxy.policies.base import RequestInfo


def load_key(inst: Instance) -> tuple[int, int]:
    return inst.load


class LeastLoad:
    """Ties (e.g. every instance idle) rotate, so an idle pool is still spread evenly."""

    name = "least_load"

    def __init__(self) -> None:
        self._turn = 0

    def choose(self, candidates: Sequence[Instance], req: RequestInfo) -> Instance:
        if len(candidates) == 1:
            return candidates[0]
        best = min(load_key(i) for i in candidates)
        tied = [i for i in candidates if load_key(i) == best]
        self._turn += 1
        return tied[self._turn % len(tied)]

    def on_routed(self, inst: Instance, req: RequestInfo) -> None:
        pass
