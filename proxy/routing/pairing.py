"""Whether a P may push into a D: by their registrations (revision, KV identity, TP sizes; an
instance the registry does not describe is not held back) and not quarantined since their first
tokens differed (``proxy.integrity``). The one check the selector and the canaries share."""

from __future__ import annotations

import logging

from proxy.instances import Instance, unpairable
from proxy.integrity import PairGuard

log = logging.getLogger("pdgate.proxy")


class Pairing:
    def __init__(self, guard: PairGuard | None) -> None:
        self.guard = guard
        self._told: set[tuple[str, str, str]] = set()  # (P, D, reason): logged once per pair

    def allows(self, p: Instance, d: Instance) -> bool:
        """Each registered pair that can never push is logged once (the metric
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
        return self.guard is None or not self.guard.blocked(p, d)
