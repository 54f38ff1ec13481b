"""Non-blocking metaserver reads for the scheduler: one asyncio loop thread, aiohttp client.

``schedule()`` asks, never waits: each method returns what is known now and starts a
background fetch when needed. Results are read back on a later step. One thread serves any
number of concurrent long-polls (no thread per request).
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from typing import Any

from pdwire.client import AsyncMetaserverClient, ConflictError, NotFoundError
from pdwire.models import Binding, BindingState, Instance, InstanceRole

log = logging.getLogger("pdgate.connector.lookups")

Verdict = bool | None  # True trusted, False rejected, None not known yet
# Between tries to take a binding while the metaserver does not answer: a stalled or failing
# over metaserver (a Redis Sentinel failover takes seconds) should delay a push, not cancel it.
CLAIM_PAUSE_S = 0.5


@dataclass(frozen=True, slots=True)
class Claim:
    """The outcome of P's compare-and-set ``bound → prefill_started`` on a binding."""

    won: bool
    why: str = ""  # when lost: the reason P pushes nothing
    record: Binding | None = None  # when won: the binding as the metaserver holds it


class Lookups:
    def __init__(
        self,
        client_factory: Callable[[], AsyncMetaserverClient],
        *,
        binding_wait_s: float,
        instance_ttl_s: float,
        doubt_ttl_s: float = 0.5,
        clock: Callable[[], float] = time.monotonic,
        wall: Callable[[], float] = time.time,
    ) -> None:
        self._factory = client_factory
        self._wait = binding_wait_s
        self._ttl = instance_ttl_s
        self._doubt_ttl = min(doubt_ttl_s, instance_ttl_s)
        self._clock = clock
        self._wall = wall
        self._lock = threading.Lock()
        self._bindings: dict[str, Binding | Exception] = {}
        self._binding_pending: set[str] = set()
        self._claims: dict[str, Claim | None] = {}  # None: under way
        self._instances: dict[str, tuple[Instance | None, float]] = {}
        self._instance_pending: set[str] = set()
        self._loop = asyncio.new_event_loop()
        self._client: AsyncMetaserverClient | None = None
        self._thread = threading.Thread(target=self._run, name="pdgate-lookups", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        self._loop.run_forever()

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        asyncio.run_coroutine_threadsafe(coro, self._loop)

    def _http(self) -> AsyncMetaserverClient:
        if self._client is None:
            self._client = self._factory()
        return self._client

    # -- bindings (concurrent mode) ---------------------------------------------------------
    def binding(self, transfer_id: str) -> Binding | Exception | None:
        """The binding (or the error fetching it); ``None`` while the fetch is under way."""
        with self._lock:
            found = self._bindings.get(transfer_id)
            if found is not None or transfer_id in self._binding_pending:
                return found
            self._binding_pending.add(transfer_id)
        self._spawn(self._fetch_binding(transfer_id))
        return None

    def forget_binding(self, transfer_id: str) -> None:
        with self._lock:
            self._bindings.pop(transfer_id, None)
            self._claims.pop(transfer_id, None)

    # -- the lease: P takes a transfer before it writes anything -----------------------------
    def claim(self, transfer_id: str, actor: str, until: float = 0.0) -> Claim | None:
        """P's ``bound → prefill_started`` (started once; ``None`` while under way). Lost when
        the binding already ended (D aborted it, the deadline passed): then D may
        have freed the blocks, so nothing may be written into them. While the metaserver does
        not answer, it is tried again until ``until`` (wall clock; 0: the client's own retries
        only): the deadline P may write by, so a late claim never leads to a late write."""
        with self._lock:
            if transfer_id in self._claims:
                return self._claims[transfer_id]
            self._claims[transfer_id] = None
        self._spawn(self._claim(transfer_id, actor, until))
        return None

    async def _claim(self, transfer_id: str, actor: str, until: float) -> None:
        tries = 0
        while True:
            tries += 1
            try:
                record = await self._http().post_event(
                    transfer_id, BindingState.PREFILL_STARTED, actor
                )
                result = _held(record, actor)
            except ConflictError as exc:
                result = Claim(
                    False,
                    f"the binding ended before P took it, or another prefill instance holds "
                    f"its lease ({exc.detail})",
                )
            except NotFoundError:
                result = Claim(False, "the binding is gone (expired or deleted) before P took it")
            except Exception as exc:  # unreachable metaserver: without the lease, no push
                if self._wall() + CLAIM_PAUSE_S < until:
                    if tries == 1:
                        log.warning(
                            "taking binding %s: %s; trying again until D's deadline",
                            transfer_id,
                            exc,
                        )
                    await asyncio.sleep(CLAIM_PAUSE_S)
                    continue
                result = Claim(False, f"could not take the binding: {exc}")
            if tries > 1:
                log.info("binding %s: %d tries to take it", transfer_id, tries)
            break
        with self._lock:
            if transfer_id in self._claims:
                self._claims[transfer_id] = result

    async def _fetch_binding(self, transfer_id: str) -> None:
        result: Binding | Exception
        try:
            result = await self._http().get_binding(transfer_id, wait=self._wait)
        except Exception as exc:
            result = exc
        with self._lock:
            self._binding_pending.discard(transfer_id)
            self._bindings[transfer_id] = result

    # -- registry (a request must not pick where P pushes) ---------------------------------
    def trusted(self, b: Binding) -> Verdict:
        """Is ``b``'s decode instance registered, as a decoder, at the same KV endpoint?

        A yes is kept for ``instance_ttl_s`` and served while it is being refreshed (an
        unreachable metaserver does not stop pushes to a decoder it vouched for). A no lives
        only ``doubt_ttl_s`` and is never served stale (``None`` until the answer is new): the
        decoder may have registered, re-registered elsewhere or come back from a missed
        heartbeat since.
        """
        now = self._clock()
        with self._lock:
            cached = self._instances.get(b.decode_instance_id)
            verdict = None if cached is None else _vouches(cached[0], b)
            ttl = self._ttl if verdict else self._doubt_ttl
            fresh = cached is not None and now - cached[1] < ttl
            if not fresh and b.decode_instance_id not in self._instance_pending:
                self._instance_pending.add(b.decode_instance_id)
                self._spawn(self._fetch_instance(b.decode_instance_id))
        return verdict if verdict or fresh else None

    def instance(self, instance_id: str) -> Instance | None:
        """The registration ``trusted`` last fetched for ``instance_id`` (``None``: none)."""
        with self._lock:
            cached = self._instances.get(instance_id)
        return None if cached is None else cached[0]

    async def _fetch_instance(self, instance_id: str) -> None:
        inst: Instance | None
        try:
            inst = await self._http().get_instance(instance_id)
        except NotFoundError:
            inst = None
        except Exception as exc:
            log.warning("registry lookup of %s failed: %s", instance_id, exc)
            with self._lock:
                self._instance_pending.discard(instance_id)
            return
        with self._lock:
            self._instance_pending.discard(instance_id)
            self._instances[instance_id] = (inst, self._clock())

    def close(self) -> None:
        """Cancel the fetches in flight, close the client, stop and close the loop."""

        async def _close() -> None:
            others = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for task in others:
                task.cancel()
            await asyncio.gather(*others, return_exceptions=True)
            if self._client is not None:
                await self._client.close()

        if self._loop.is_running():
            fut = asyncio.run_coroutine_threadsafe(_close(), self._loop)
            try:
                fut.result(2.0)
            except Exception:
                pass
            self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(2.0)
        if not self._thread.is_alive() and not self._loop.is_closed():
            self._loop.close()


def _held(record: Binding, actor: str) -> Claim:
    """The claim a 200 answer gives: won only if the lease in the record is ``actor``'s (the
    first ``prefill_started`` wins; a metaserver before the exclusive lease answered a second
    one with 200 too)."""
    holder = next((e.actor for e in record.events if e.state is BindingState.PREFILL_STARTED), None)
    if holder == actor:
        return Claim(True, record=record)
    if holder is None:
        return Claim(False, "the binding's record shows no lease after P took it")
    return Claim(False, f"another prefill instance ({holder[:128]!r}) holds the lease")


def _vouches(inst: Instance | None, b: Binding) -> bool:
    return (
        inst is not None
        and inst.role in (InstanceRole.DECODE, InstanceRole.BOTH)
        and inst.kv_endpoint == b.kv_endpoint
    )
