"""power_of_two: sample two instances at random, keep the less loaded."""

from __future__ import annotations

import random
from collections.abc import Sequence

from proxy.instances import Instance
from proxy.policies.base import RequestInfo
from proxy.policies.least_load import load_key


class PowerOfTwo:
    name = "power_of_two"

    def __init__(self, rng: random.Random | None = None) -> None:
        self._rng = rng or random.Random()

    def choose(self, candidates: Sequence[Instance], req: RequestInfo) -> Instance:
        if len(candidates) == 1:
            return candidates[0]
        a, b = self._rng.sample(list(candidates), 2)
        return a if load_key(a) <= load_key(b) else b

    def on_routed(self, inst: Instance, req: RequestInfo) -> None:
        pass
