"""Active-active proxy replicas (``--share-load``): this replica reports its in-flight load per
instance, its open circuits and each instance's recent prefill work to the metaserver
(``PUT /v1/load/{replica}``) and takes back the other replicas' sum, which the policies add to
its own (``Instance.load``, ``Instance.work``). An instance whose circuit another replica has
open is not chosen here either.

When: every ``interval_s``; within ``FRESH_S`` of a choice (``changed``: coalesced, so at most
one report per ``FRESH_S`` from choices); and before a choice whose view of the others is older
than ``FRESH_S`` (``fresh``: it waits at most ``WAIT_S``, then routes on the view it has). So
two replicas choosing a few tens of milliseconds apart see each other's choice; at the interval
alone they were blind for up to two intervals, and requests that arrive together (a burst, or
the next requests of clients whose answers ended together) went to the same P.

Reports are whole snapshots that lapse after ``3 * interval_s`` (at least a second), so a
replica that dies stops counting; when this replica cannot reach the metaserver for as long, it
forgets the others' load and routes on its own view until it can. While the last exchange
failed, a choice does not wait for one.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Callable
from typing import Protocol

from pdwire.models import LoadReport, LoadView
from proxy.instances.circuit import CircuitState
from proxy.instances.registry import Registry

log = logging.getLogger("pdgate.proxy.share")
FRESH_S = 0.02
WAIT_S = 0.05


class LoadExchange(Protocol):
    """``pdwire.client.AsyncMetaserverClient`` (one without retries)."""

    async def share_load(self, replica: str, report: LoadReport) -> LoadView:
        """Report ``replica``'s load; the others' (raises on any failure)."""
        ...


class LoadSync(Protocol):
    """What the dispatcher tells the shared load, and waits for (``NoSharing`` without it)."""

    async def fresh(self) -> None:
        """Before a choice: the other replicas' load, recent enough."""
        ...

    def changed(self) -> None:
        """This replica just chose an instance."""
        ...


class NoSharing:
    async def fresh(self) -> None:
        return None

    def changed(self) -> None:
        return None


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
        self._viewed_at = -math.inf  # when the exchange that gave the current view was sent
        self._ok = False  # the last exchange succeeded
        self._exchanging: asyncio.Task[None] | None = None
        self._wake = asyncio.Event()
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
        sent = self._clock()
        try:
            view = await self._exchange.share_load(self.replica, self.snapshot())
        except Exception as exc:
            self.failures += 1
            self._ok = False
            if self._clock() > self._fresh_until:
                self.apply(None)
            log.debug("load not shared: %s", exc)
            return
        self._ok = True
        self._viewed_at = max(self._viewed_at, sent)
        self._fresh_until = self._clock() + self.stale_s
        self.apply(view)

    def _exchange_now(self) -> asyncio.Task[None]:
        """The exchange in flight, or a new one: concurrent callers share it."""
        if self._exchanging is None or self._exchanging.done():
            self._exchanging = asyncio.ensure_future(self.once())
        return self._exchanging

    async def fresh(self) -> None:
        if not self._ok or self._clock() - self._viewed_at <= FRESH_S:
            return
        try:
            await asyncio.wait_for(asyncio.shield(self._exchange_now()), WAIT_S)
        except TimeoutError:
            pass  # it lands later; this choice goes on the view there is

    def changed(self) -> None:
        self._wake.set()

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
        try:
            while True:
                self._wake.clear()
                await self._exchange_now()
                try:
                    await asyncio.wait_for(self._wake.wait(), self.interval_s)
                except TimeoutError:
                    continue
                await asyncio.sleep(FRESH_S)  # the choices of a burst go in one report
        finally:
            if self._exchanging is not None:
                self._exchanging.cancel()
