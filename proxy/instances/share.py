"""Active-active proxy replicas (``--share-load``): every ``interval_s`` this replica reports
its in-flight load per instance, its open circuits and each instance's recent prefill work to
the metaserver (``PUT /v1/load/{replica}``) and takes back the other replicas' sum, which the
policies add to its own (``Instance.load``, ``Instance.work``). An instance whose circuit
another replica has open is not chosen here either. Reports are whole snapshots that lapse
after ``3 * interval_s`` (at least a second), so a replica that dies stops counting; when this
replica cannot reach the metaserver for as long, it forgets the others' load and routes on its
own view until it can.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Protocol

from pdwire.models import LoadReport, LoadView
from proxy.instances.circuit import CircuitState
from proxy.instances.registry import Registry

log = logging.getLogger("pdgate.proxy.share")


class LoadExchange(Protocol):
    """``pdwire.client.AsyncMetaserverClient`` (one without retries)."""

    async def share_load(self, replica: str, report: LoadReport) -> LoadView:
        """Report ``replica``'s load; the others' (raises on any failure)."""
        ...


class LoadShare:
    def __init__(
        self,
        registry: Registry,
        exchange: LoadExchange,
        replica: str,
        interval_s: float,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._clock = clock
        self._registry = registry
        self._exchange = exchange
        self.replica = replica
        self.interval_s = interval_s
        self.stale_s = max(3 * interval_s, 1.0)
        self._fresh_until = 0.0
        self.failures = 0
        self.replicas = 1

    def snapshot(self) -> LoadReport:
        instances = {}
        open_ = []
        recent = {}
        now = self._clock()
        for inst in self._registry.instances():
            if inst.inflight or inst.tokens:
                instances[inst.url] = (max(inst.inflight, 0), max(inst.tokens, 0))
            if inst.circuit.state is CircuitState.OPEN:
                open_.append(inst.url)
            work = int(inst.work.own(now))
            if work > 0:
                recent[inst.url] = work
        return LoadReport(
            instances=instances, open_circuits=open_, recent=recent, ttl_s=self.stale_s
        )

    async def once(self) -> None:
        try:
            view = await self._exchange.share_load(self.replica, self.snapshot())
        except Exception as exc:
            self.failures += 1
            if self._clock() > self._fresh_until:
                self.apply(None)
            log.debug("load not shared: %s", exc)
            return
        self._fresh_until = self._clock() + self.stale_s
        self.apply(view)

    def apply(self, view: LoadView | None) -> None:
        others = {} if view is None else view.others
        opened = set() if view is None else set(view.open_circuits)
        recent = {} if view is None else view.recent
        self.replicas = 1 if view is None else view.replicas
        for inst in self._registry.instances():
            n, tokens = others.get(inst.url, (0, 0))
            inst.remote_inflight, inst.remote_tokens = n, tokens
            inst.remote_open = inst.url in opened
            inst.work.remote = recent.get(inst.url, 0)

    async def run(self) -> None:
        while True:
            await self.once()
            await asyncio.sleep(self.interval_s)
