"""round_robin: each pool in turn."""

from __future__ import annotations

import itertools
from collections.abc import Sequence

from proxy.instances import Instance
from proxy.policies.base import RequestInfo


class RoundRobin:
    name = "round_robin"

    def __init__(self) -> None:
        self._next = itertools.count()

    def choose(self, candidates: Sequence[Instance], req: RequestInfo) -> Instance:
        return candidates[next(self._next) % len(candidates)]

    def on_routed(self, inst: Instance, req: RequestInfo) -> None:
        pass
