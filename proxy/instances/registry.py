"""The proxy's view of both pools. Discovery sources call ``reconcile``; flows call ``pool``.

An instance that disappears from discovery is *drained*: it gets no new requests and is
forgotten once its in-flight requests are done.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable

from proxy.instances.circuit import CircuitBreaker
from proxy.instances.instance import Instance, Role

log = logging.getLogger("pdgate.proxy.instances")


class Registry:
    def __init__(
        self,
        *,
        circuit_failures: int = 5,
        circuit_open_s: float = 10.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._failures = circuit_failures
        self._open_s = circuit_open_s
        self._clock = clock
        self._pools: dict[Role, dict[str, Instance]] = {Role.PREFILL: {}, Role.DECODE: {}}
        self._lists: dict[Role, list[Instance]] = {Role.PREFILL: [], Role.DECODE: []}

    def reconcile(self, role: Role, urls: Iterable[str]) -> None:
        """Make ``urls`` the pool of ``role``: add new ones, drain the missing ones."""
        pool = self._pools[role]
        wanted = {u.rstrip("/") for u in urls}
        for url in wanted:
            inst = pool.get(url)
            if inst is None:
                pool[url] = Instance(
                    url, role, CircuitBreaker(self._failures, self._open_s, self._clock)
                )
                log.info("%s instance added: %s", role.value, url)
            elif inst.draining:
                inst.draining = False
                log.info("%s instance back: %s", role.value, url)
        for url, inst in list(pool.items()):
            if url not in wanted and not inst.draining:
                inst.draining = True
                log.info("%s instance draining: %s (%d in flight)", role.value, url, inst.inflight)
        self.sweep()

    def sweep(self) -> None:
        """Forget drained instances with nothing in flight; refresh the pool lists."""
        for role, pool in self._pools.items():
            for url, inst in list(pool.items()):
                if inst.draining and inst.inflight <= 0:
                    del pool[url]
                    log.info("%s instance removed: %s", role.value, url)
            self._lists[role] = list(pool.values())

    def all(self, role: Role) -> list[Instance]:
        return self._lists[role]

    def available(self, role: Role, exclude: frozenset[str] = frozenset()) -> list[Instance]:
        return [i for i in self._lists[role] if i.available() and i.url not in exclude]

    def panic(self, role: Role) -> list[Instance]:
        """Instances of ``role`` out of selection only because their health probes timed out
        (not draining, circuit closed): when none is healthy, a busy engine that answers probes
        late is a better bet than a certain 503 (an engine saturated by a long prefill can miss
        two 2 s probes). One that answered its probe with an error stays out."""
        return [
            i
            for i in self._lists[role]
            if not i.healthy and i.slow and not i.draining and i.circuit.allows()
        ]

    def instances(self) -> list[Instance]:
        return self._lists[Role.PREFILL] + self._lists[Role.DECODE]
