"""random: uniform choice."""

from __future__ import annotations

import random as _random
from collections.abc import Sequence

from proxy.instances import Instance
from proxy.policies.base import RequestInfo


class RandomChoice:
    name = "random"

    def __init__(self, rng: _random.Random | None = None) -> None:
        self._rng = rng or _random.Random()

    def choose(self, candidates: Sequence[Instance], req: RequestInfo) -> Instance:
        return self._rng.choice(candidates)

    def on_routed(self, inst: Instance, req: RequestInfo) -> None:
        pass
