"""decode-first with a metaserver binding (the layerwise push flow).

1. D gets the request with ``{do_remote_prefill, transfer_id, metaserver}``; its connector
   allocates blocks and writes the binding.
2. The proxy long-polls the binding, then sends P the prefill request carrying it (``decode``,
   the metaserver's JSON embedded as it came); P pushes KV into D's blocks and signals D.
   *Concurrent* mode sends P at once, without the binding: P's connector fetches it itself.
3. D's leg runs in its own task; the binding wait and P's leg run in the request's task. A D
   failure meanwhile interrupts them (cancel + ``uncancel``, no extra tasks or ``wait`` sets);
   any failure drops the other leg (closing D's connection aborts its request, so nothing
   waits for KV that will never come) and marks the binding ``failed`` (P errored) or
   ``aborted`` (anything else), fire-and-forget.
4. P's answer says ``push: none`` when its connector refused the binding (a decoder the
   registry does not vouch for, a block size or TP pairing it cannot serve, D's deadline
   already gone): D would wait its whole load deadline for KV that will never come, so the
   proxy drops D's leg and sends D the plain request instead; D computes the prompt itself.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

import msgspec

from pdwire.models import BindingState
from pdwire.params import decode_leg, prefill_leg
from proxy.backend import LegError
from proxy.errors import BindingTimeout, UpstreamError
from proxy.events import EventSink
from proxy.flows.base import (
    Attempt,
    Legs,
    PrefillAnswer,
    Upstream,
    no_push_reason,
    prefill_cached,
)
from proxy.flows.bindings import BindingMissing, BindingSource

log = logging.getLogger("pdgate.proxy.flows")


class _DecodeWatch:
    """While armed, D's task failing interrupts the request's task, and so does D answering:
    at once (``any_end``: the binding wait), or after ``grace`` seconds (P's leg: P's report
    may still come; a P that hangs must not hold D's answer)."""

    __slots__ = ("_timer", "any_end", "armed", "fired", "grace", "task")

    def __init__(self, task: asyncio.Task[Any], grace: float) -> None:
        self.task = task
        self.grace = grace
        self.armed = False
        self.any_end = True
        self.fired = False
        self._timer: asyncio.TimerHandle | None = None

    def __call__(self, d_task: asyncio.Task[Upstream]) -> None:
        if not self.armed or self.fired:
            return
        if self.any_end or d_task.cancelled() or d_task.exception() is not None:
            self._fire()
        else:
            self._timer = self.task.get_loop().call_later(self.grace, self._fire)

    def _fire(self) -> None:
        self._timer = None
        if self.armed and not self.fired:
            self.fired = True
            self.task.cancel()

    def disarm(self) -> None:
        self.armed = False
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def absorb(self) -> bool:
        """In an ``except CancelledError``: True when the cancel was ours alone."""
        return self.fired and self.task.uncancel() == 0


class DecodeFirst:
    needs_prefill = True

    def __init__(
        self, legs: Legs, bindings: BindingSource, events: EventSink, *, concurrent: bool = False
    ) -> None:
        self._legs = legs
        self._bindings = bindings
        self._events = events
        self._concurrent = concurrent
        self._wait_s = legs.timeouts.binding_wait
        self._grace_s = legs.timeouts.prefill_grace
        self._binding_hist = legs.metrics.binding_wait_seconds
        self.name = "concurrent" if concurrent else "decode-first"

    async def open(self, a: Attempt) -> Upstream:
        url = self._bindings.base_url
        d_kv = decode_leg(a.tid, url)
        binding: msgspec.Raw | None = None
        task = asyncio.current_task()
        assert task is not None
        d_task = asyncio.get_running_loop().create_task(
            self._legs.decode(a, a.req.for_decode(d_kv))
        )
        watch = _DecodeWatch(task, self._grace_s)
        d_task.add_done_callback(watch)
        try:
            if not self._concurrent:
                watch.armed = True
                try:
                    binding = await self._binding(a)
                except asyncio.CancelledError:
                    if not watch.absorb():
                        raise
                    return await d_task  # D answered (or failed) without waiting for KV
                watch.disarm()
            # from now on D's failure interrupts P at once, D's answer after the grace (a D
            # that ended since the binding came has its callback pending: it runs armed, at
            # P's leg's first await)
            watch.any_end = False
            watch.armed = True
            try:
                answer: PrefillAnswer = await self._legs.prefill(
                    a, prefill_leg(a.tid, url, binding)
                )
            except asyncio.CancelledError:
                if not watch.absorb():
                    raise
                if _answered(d_task):
                    return self._without_prefill(a, d_task.result())
                await d_task  # raises D's error
                raise
            watch.disarm()
            why = no_push_reason(answer)
            if why is None or _answered(d_task):
                up = await d_task
        except BaseException as exc:
            watch.disarm()
            _drop(d_task)
            failed = isinstance(exc, LegError) and exc.leg == "prefill"
            state = BindingState.FAILED if failed else BindingState.ABORTED
            self._events.post(a.tid, state, str(exc) or type(exc).__name__)
            raise
        if why is not None and not _answered(d_task):
            return await self._decode_alone(a, d_task, why)
        up.prefill_cached = prefill_cached(answer)
        up.binding_tracked = True
        return up

    def _without_prefill(self, a: Attempt, up: Upstream) -> Upstream:
        """D answered and P did not within the grace: P's leg was cancelled (its request
        aborted); D's answer goes out without P's report or cached-token count."""
        log.warning(
            "%s: D answered; P's answer not in %.1fs later, its leg dropped", a.tid, self._grace_s
        )
        self._legs.metrics.prefill_dropped.inc()
        up.binding_tracked = True
        return up

    async def _decode_alone(self, a: Attempt, d_task: asyncio.Task[Upstream], why: str) -> Upstream:
        _drop(d_task)
        log.warning("%s: P pushed nothing (%s); D computes the prompt itself", a.tid, why)
        self._legs.metrics.no_push.inc()
        self._events.post(a.tid, BindingState.FAILED, f"P pushed nothing: {why}")
        up = await self._legs.decode(a, a.req.for_decode(None))
        up.binding_tracked = True  # the failed binding's timeline gets D's first token and end
        return up

    async def _binding(self, a: Attempt) -> msgspec.Raw:
        t0 = time.perf_counter()
        try:
            raw = await self._bindings.wait(a.tid, self._wait_s)
        except BindingMissing as exc:
            err = BindingTimeout(f"no binding for {a.tid} within {self._wait_s}s")
            raise LegError(err, a.decode.url, "binding") from exc
        except UpstreamError as exc:
            err2 = UpstreamError(f"metaserver: {exc.message}")
            raise LegError(err2, self._bindings.base_url, "binding") from exc
        self._binding_hist.observe(time.perf_counter() - t0)
        return raw


def _answered(d_task: asyncio.Task[Upstream]) -> bool:
    return d_task.done() and not d_task.cancelled() and d_task.exception() is None


def _drop(d_task: asyncio.Task[Upstream]) -> None:
    """Cancel D's leg if it still runs; close its answer if it came; retrieve its error."""
    if not d_task.done():
        d_task.cancel()
    elif not d_task.cancelled() and d_task.exception() is None:
        d_task.result().close()
