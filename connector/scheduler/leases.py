"""Leases P took for requests that ended before any of their blocks went to the workers.

P's lease (``bound → prefill_started``) tells D to hold its blocks until P's done signal: P may
be writing into them. When P's request ends first (the client left and the proxy dropped it, P
aborted or failed it) before a single chunk went to the workers, no worker knows the transfer,
so no signal would ever come and D would hold the blocks until its load deadline. Here the
scheduler hands such a lease to the workers (``PdgateMetadata.abandoned``), and they send D a
failed end at once: nothing was written, nothing more will be.

The claim is asynchronous (``Lookups.claim``), so a request can end while its claim is still on
its way, or won but not yet read back: that lease is watched until the answer is known, and
closed if P won it.
"""

from __future__ import annotations

import logging

from connector.metadata import Abandoned, PdgateMetadata
from connector.scheduler.lookups import Lookups

log = logging.getLogger("pdgate.connector.leases")


class LeaseCloser:
    def __init__(self, lookups: Lookups, actor: str) -> None:
        self._lookups = lookups
        self._actor = actor
        self._waiting: dict[str, Abandoned] = {}  # by transfer id: the claim's answer to come
        self._closing: list[Abandoned] = []  # for the next step's metadata

    def close(self, lease: Abandoned) -> None:
        """P holds the lease: D is told in the next step."""
        log.info("transfer %s: P's request ended before its push; D is told", lease.transfer_id)
        self._closing.append(lease)

    def watch(self, lease: Abandoned) -> None:
        """P asked for the lease and has not read the answer: close it if P won."""
        self._waiting[lease.transfer_id] = lease

    def fill(self, meta: PdgateMetadata) -> None:
        for tid, lease in list(self._waiting.items()):
            claim = self._lookups.claim(tid, self._actor)  # started: only reads the answer
            if claim is None:
                continue
            del self._waiting[tid]
            self._lookups.forget_binding(tid)
            if claim.won:
                self.close(lease)
        meta.abandoned.extend(self._closing)
        self._closing.clear()

    @property
    def pending(self) -> bool:
        """Leases still to close: vLLM must keep stepping an engine with no request left."""
        return bool(self._waiting or self._closing)
