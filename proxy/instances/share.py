"""Active-active proxy replicas (``--share-load``): this replica reports its in-flight load per
instance, its open circuits and each instance's recent prefill work to the metaserver
(``PUT /v1/load/{replica}``) and takes back the other replicas' sum, which the policies add to
its own (``Instance.load``, ``Instance.work``). An instance whose circuit another replica has
open is not chosen here either.

When: every ``interval_s``, and at once after a change (``changed``: a choice, or load
released, so the others do not count a freed P as busy until the interval; one report in flight
at a time, the next as soon as it ends while changes are left unreported); and before every
choice it reads the others' load (``fresh``: ``GET``, joining a read in flight, waiting at most
``WAIT_S``, then routing on the view it has). A replica's choice is on the board one round
trip after it is made and the other replicas' next choices read it: two replicas are blind to
each other only for choices less than about two round trips apart. The read before a choice is
the time to first token sharing costs (``tests/bench/share_bench.py``); it is a read because
with Redis on ``appendfsync always`` a write is answered only after the disk has it, while
what it wrote is visible to other readers at once. Answers apply in the order they were asked,
so a report answered late does not undo a newer read.

Reports are whole snapshots that lapse after ``3 * interval_s`` (at least a second), so a
replica that dies stops counting; when this replica cannot reach the metaserver for as long, it
forgets the others' load and routes on its own view until it can. While the last exchange
failed, a choice does not wait for one.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Protocol

from pdwire.models import LoadReport, LoadView
from proxy.instances.circuit import CircuitState
from proxy.instances.registry import Registry

log = logging.getLogger("pdgate.proxy.share")
WAIT_S = 0.05


class LoadExchange(Protocol):
    """``pdwire.client.AsyncMetaserverClient`` (one without retries)."""

    async def share_load(self, replica: str, report: LoadReport) -> LoadView:
        """Report ``replica``'s load; the others' (raises on any failure)."""
        ...

    async def view_load(self, replica: str) -> LoadView:
        """The others' load, reporting nothing (raises on any failure)."""
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
        self._ok = False  # the last exchange succeeded
        self._asked = 0  # exchanges sent
        self._applied = 0  # the latest of them whose answer is applied
        self._looking: asyncio.Task[None] | None = None
        self._wake = asyncio.Event()
        self.failures = 0
        self.replicas = 1
        self.overruled = 0  # views whose open circuits would have emptied a pool (ignored)

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
        """Report this replica's load; apply the others' that comes back."""
        await self._ask(self._exchange.share_load(self.replica, self.snapshot()))

    async def look(self) -> None:
        """Read the others' load."""
        await self._ask(self._exchange.view_load(self.replica))

    async def _ask(self, call: Awaitable[LoadView]) -> None:
        self._asked += 1
        asked = self._asked
        try:
            view = await call
        except Exception as exc:
            self.failures += 1
            self._ok = False
            if self._clock() > self._fresh_until:
                self.apply(None)
            log.debug("load not shared: %s", exc)
            return
        self._ok = True
        self._fresh_until = self._clock() + self.stale_s
        if asked > self._applied:  # not older than the view in place
            self._applied = asked
            self.apply(view)

    async def fresh(self) -> None:
        if not self._ok:
            return
        if self._looking is None or self._looking.done():  # concurrent choices share a read
            self._looking = asyncio.ensure_future(self.look())
        try:
            await asyncio.wait_for(asyncio.shield(self._looking), WAIT_S)
        except TimeoutError:
            pass  # it lands later; this choice goes on the view there is

    def changed(self) -> None:
        self._wake.set()

    def apply(self, view: LoadView | None) -> None:
        others = {} if view is None else view.others
        opened = set() if view is None else set(view.open_circuits)
        recent = {} if view is None else view.recent
        self.replicas = 1 if view is None else view.replicas
        instances = self._registry.instances()
        for inst in instances:
            n, tokens = others.get(inst.url, (0, 0))
            inst.remote_inflight, inst.remote_tokens = n, tokens
            inst.remote_open = inst.url in opened
            inst.work.remote = recent.get(inst.url, 0)
        for role in {i.role for i in instances}:
            pool = [i for i in instances if i.role is role]
            if not any(i.available() for i in pool) and any(i.remote_open for i in pool):
                # the others' open circuits would leave this pool empty: one report may name
                # every instance (any proxy-role caller), so this replica's own view chooses
                self.overruled += 1
                for inst in pool:
                    inst.remote_open = False

    async def run(self) -> None:
        try:
            while True:
                self._wake.clear()
                await self.once()  # a choice made while it is out sets the wake again
                if not self._ok:  # not a tight loop against a metaserver that is down
                    await asyncio.sleep(self.interval_s)
                    continue
                try:
                    await asyncio.wait_for(self._wake.wait(), self.interval_s)
                except TimeoutError:
                    pass
        finally:
            if self._looking is not None:
                self._looking.cancel()
