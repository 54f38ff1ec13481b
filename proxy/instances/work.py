"""An instance's recent work: the uncached prefill tokens a policy sent it, decaying
exponentially with time constant ``WORK_TAU_S``. The ``kv`` policy breaks its ties on it (the P
that computed least lately); ``--share-load`` adds the other replicas' (``remote``), so every
replica breaks them alike."""

from __future__ import annotations

import math

WORK_TAU_S = 60.0


class RecentWork:
    __slots__ = ("remote", "since", "value")

    def __init__(self) -> None:
        self.value = 0.0  # this replica's, as of ``since``
        self.since = 0.0
        self.remote = 0  # the other replicas' sum, as last shared (``proxy.instances.share``)

    def own(self, now: float) -> float:
        return self.value * math.exp(-(now - self.since) / WORK_TAU_S)

    def at(self, now: float) -> float:
        """Every replica's, this one's as of ``now``."""
        return self.own(now) + self.remote

    def add(self, tokens: int, now: float) -> None:
        self.value = self.own(now) + tokens
        self.since = now
