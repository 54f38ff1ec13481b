"""The proxy's view of both pools. Discovery sources call ``reconcile``; flows call ``pool``.

An instance that disappears from discovery is *drained*: it gets no new requests and is
forgotten once its in-flight requests are done. An instance can also be drained on purpose
(``apply_registry`` from the metaserver registry's ``draining`` flags, ``drain_local`` by an
admin call): it gets no new requests, finishes what it has, and stays known until undrained.
Drains are kept by URL, so they also hold for an instance discovery adds later.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable

from pdwire.models import Instance as Registered
from proxy.instances.circuit import CircuitBreaker
from proxy.instances.instance import Instance, Role, local_id

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
        self._ids: dict[str, str] = {}  # url -> instance id in the metaserver registry
        self._remote: set[str] = set()  # urls whose registration says draining
        self._local: set[str] = set()  # urls drained by an admin call on this proxy
        self._specs: dict[str, Registered] = {}  # url -> its registration (last registry poll)

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
        self._flag()

    # ---- drains ---------------------------------------------------------------------------
    def apply_registry(self, registered: Iterable[Registered]) -> None:
        """The metaserver registry's live instances: names this proxy's instances and sets
        their remote drains. A drained instance whose registration is gone (it
        deregistered on shutdown) stays drained while the proxy still knows its URL: it is
        taken back only once it registers again undrained (a restart)."""
        listed: dict[str, tuple[str, bool]] = {}
        specs: dict[str, Registered] = {}
        for rec in registered:
            listed[rec.url.rstrip("/")] = (rec.instance_id, rec.draining)
            specs[rec.url.rstrip("/")] = rec
        self._specs = specs
        for url, (iid, draining) in listed.items():
            self._ids[url] = iid
            if draining:
                self._remote.add(url)
            else:
                self._remote.discard(url)
        known = {i.url for i in self.instances()}
        self._remote = {u for u in self._remote if u in listed or u in known}
        self._ids = {u: i for u, i in self._ids.items() if u in listed or u in self._remote}
        self._flag()

    def drain_remote(self, rec: Registered) -> None:
        """One registration this proxy just changed (the next registry poll says the same)."""
        url = rec.url.rstrip("/")
        self._ids[url] = rec.instance_id
        if rec.draining:
            self._remote.add(url)
        else:
            self._remote.discard(url)
        self._flag()

    def drain_local(self, urls: Iterable[str], draining: bool) -> None:
        """Drain (or undrain) on this proxy only; undraining also clears a remote drain this
        proxy still holds for a registration that is gone."""
        for url in urls:
            if draining:
                self._local.add(url)
            else:
                self._local.discard(url)
                self._remote.discard(url)
        self._flag()

    def find(self, instance_id: str) -> list[Instance]:
        """This proxy's instances of that id (both pools for a ``both`` instance)."""
        return [i for i in self.instances() if i.id == instance_id]

    def _flag(self) -> None:
        for role in Role:
            for inst in self._pools[role].values():
                inst.id = self._ids.get(inst.url) or local_id(inst.url)
                inst.spec = self._specs.get(inst.url)
                remote = inst.url in self._remote
                local = inst.url in self._local
                if (remote, local) != (inst.drained_remote, inst.drained_local):
                    log.info(
                        "%s instance %s (%s) %s (%d in flight)", role.value, inst.id, inst.url,
                        "drained" if remote or local else "undrained", inst.inflight,
                    )  # fmt: skip
                inst.drained_remote = remote
                inst.drained_local = local

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
            if not i.healthy and i.slow and not i.draining and not i.drained and i.circuit.allows()
        ]

    def instances(self) -> list[Instance]:
        return self._lists[Role.PREFILL] + self._lists[Role.DECODE]
