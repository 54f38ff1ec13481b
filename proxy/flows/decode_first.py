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
   So does a binding that cannot be read: the metaserver not answering, refusing or failing
   (``MetaserverUnavailable``) would fail every attempt alike, and D needs no metaserver to
   compute the prompt. And so does P's leg breaking after P took the binding (P killed
   mid-push, read back from the binding): a retry's P would prefill the whole prompt again.
"""

from __future__ import annotations

import asyncio
import enum
import logging
import time
from collections.abc import Coroutine
from typing import TYPE_CHECKING, Any

import msgspec

from pdwire.models import BindingState, MarkKind
from pdwire.params import decode_leg, prefill_leg
from proxy.backend import LegError
from proxy.errors import BindingTimeout, MetaserverUnavailable, UpstreamError
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
from proxy.flows.watch import DecodeWatch, answered, drop

if TYPE_CHECKING:
    pass

log = logging.getLogger("pdgate.proxy.flows")


class Without(enum.Enum):
    """Why D computes the prompt itself (the label of ``pd_decode_without_prefill_total``)."""

    NO_PUSH = "no_push"  # P answered that it pushed nothing
    UNREADABLE = "binding_unreadable"  # the metaserver could not give D's binding
    P_FAILED = "prefill_failed"  # P's leg broke after P took the binding
    MISMATCH = "first_token_mismatch"  # P's first token and D's differed (``proxy.integrity``)
    FOREIGN = "binding_foreign"  # the binding names another decode than the one chosen


_WITHOUT = {
    Without.NO_PUSH: "P pushed nothing",
    Without.UNREADABLE: "binding unreadable",
    Without.P_FAILED: "P failed after taking the binding",
    Without.MISMATCH: "pair quarantined",
    Without.FOREIGN: "binding names another decode",
}


class _Names(msgspec.Struct):
    decode_instance_id: str


_names = msgspec.json.Decoder(_Names)  # reads one field of the binding P is sent as it is


def _foreign(a: Attempt, binding: msgspec.Raw) -> str | None:
    """Why ``binding`` is not the chosen D's (None: it is, or the registry does not know D):
    P must push only into the D this request was sent to."""
    if a.decode.spec is None:
        return None
    named = _names.decode(binding).decode_instance_id
    return None if named == a.decode.id else f"it names {named}, {a.decode.id} was chosen"


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
        self._binding_waits = legs.metrics.binding_waits
        self.name = "concurrent" if concurrent else "decode-first"

    async def open(self, a: Attempt) -> Upstream:
        url = self._bindings.base_url
        binding: msgspec.Raw | None = None
        task = asyncio.current_task()
        assert task is not None
        d_span = a.leg_span("decode", a.decode.url)
        d_kv = decode_leg(a.tid, url, d_span.traceparent)
        d_leg = self._legs.decode(a, a.decode_body(d_kv), d_span)
        d_task = asyncio.get_running_loop().create_task(d_leg)
        watch = DecodeWatch(task, self._grace_s)
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
                foreign = _foreign(a, binding)
                if foreign is not None:
                    return await self._decode_alone(a, d_task, foreign, Without.FOREIGN)
            # from now on D's failure interrupts P at once, D's answer after the grace (a D
            # that ended since the binding came has its callback pending: it runs armed, at
            # P's leg's first await)
            watch.any_end = False
            watch.armed = True
            try:
                answer: PrefillAnswer = await self._prefill(a, url, binding)
            except asyncio.CancelledError:
                if not watch.absorb():
                    raise
                if answered(d_task):
                    return self._without_prefill(a, d_task.result())
                await d_task  # raises D's error
                raise
            watch.disarm()
            why = no_push_reason(answer)
            if why is None or answered(d_task):
                up = await d_task
        except BaseException as exc:
            watch.disarm()
            if isinstance(exc, MetaserverUnavailable) and not d_task.done():
                return await self._decode_alone(a, d_task, exc.message, Without.UNREADABLE)
            if await self._p_failed_after_taking(a, d_task, exc):
                assert isinstance(exc, LegError)
                up = await self._decode_alone(a, d_task, exc.message, Without.P_FAILED)
                up.prefill_error = exc  # the dispatcher charges P as for a failed attempt
                return up
            drop(d_task)
            failed = isinstance(exc, LegError) and exc.leg == "prefill"
            state = BindingState.FAILED if failed else BindingState.ABORTED
            self._events.abandon(a.tid, state, str(exc) or type(exc).__name__)
            raise
        if why is not None and not answered(d_task):
            return await self._decode_alone(a, d_task, why, Without.NO_PUSH)
        up.prefill_cached = prefill_cached(answer)
        up.binding_tracked = True
        try:
            differ = await self._legs.first_tokens_differ(a, answer, up)
        except BaseException as exc:
            self._events.abandon(a.tid, BindingState.ABORTED, str(exc) or type(exc).__name__)
            raise
        if differ is not None:
            self._events.mark(a.tid, MarkKind.CORRUPT, None, differ[:64])
            return await self._decode_alone(a, d_task, differ, Without.MISMATCH)
        return up

    async def _p_failed_after_taking(
        self, a: Attempt, d_task: asyncio.Task[Upstream], exc: BaseException
    ) -> bool:
        """P's leg broke (not a 4xx) while D still waits, and P had taken the binding: P died
        or failed mid-prefill or mid-push. One read of the binding; if this request is
        cancelled meanwhile, D's leg is dropped and the binding marked failed here."""
        if not (
            isinstance(exc, LegError)
            and exc.leg == "prefill"
            and exc.retryable
            and not d_task.done()
        ):
            return False
        try:
            return await self._bindings.taken(a.tid)
        except BaseException:
            drop(d_task)
            self._events.abandon(a.tid, BindingState.FAILED, str(exc))
            raise

    def _prefill(
        self, a: Attempt, url: str, binding: msgspec.Raw | None
    ) -> Coroutine[Any, Any, PrefillAnswer]:
        assert a.prefill is not None
        span = a.leg_span("prefill", a.prefill.url)
        chosen = a.decode.id if a.decode.spec is not None else None  # P refuses another D's
        kv = prefill_leg(a.tid, url, binding, span.traceparent, chosen)
        return self._legs.prefill(a, kv, span)

    def _without_prefill(self, a: Attempt, up: Upstream) -> Upstream:
        """D answered and P did not within the grace: P's leg was cancelled (its request
        aborted); D's answer goes out without P's report or cached-token count."""
        log.warning(
            "%s: D answered; P's answer not in %.1fs later, its leg dropped", a.tid, self._grace_s
        )
        self._legs.metrics.prefill_dropped.inc()
        up.binding_tracked = True
        return up

    async def _decode_alone(
        self, a: Attempt, d_task: asyncio.Task[Upstream], why: str, without: Without
    ) -> Upstream:
        """D's leg is dropped and D gets the plain request: P pushed nothing, the binding
        could not be read, or P failed after it took the binding (``why`` says how)."""
        drop(d_task)
        what = _WITHOUT[without]
        log.warning("%s: %s (%s); D computes the prompt itself", a.tid, what, why)
        self._legs.metrics.without_prefill.labels(reason=without.value).inc()
        if without is Without.NO_PUSH:
            self._legs.metrics.no_push.inc()
        why = f"{what}: {why}"
        self._events.abandon(a.tid, BindingState.FAILED, why)
        span = a.leg_span("decode", a.decode.url)
        span.set("pdgate.without_prefill", why)
        up = await self._legs.decode(a, a.decode_body(None), span)
        up.binding_tracked = True  # the failed binding's timeline gets D's first token and end
        return up

    async def _binding(self, a: Attempt) -> msgspec.Raw:
        span = a.trace.leg("binding_wait", {"pdgate.transfer_id": a.tid})
        try:
            raw = await self._wait_binding(a)
        except BaseException as exc:
            span.end(exc)
            raise
        span.end()
        return raw

    async def _wait_binding(self, a: Attempt) -> msgspec.Raw:
        t0 = time.perf_counter()
        waiting = self._binding_waits.start()
        try:
            raw = await self._bindings.wait(a.tid, self._wait_s)
        except BindingMissing as exc:
            err = BindingTimeout(f"no binding for {a.tid} within {self._wait_s}s")
            raise LegError(err, a.decode.url, "binding") from exc
        except MetaserverUnavailable:
            raise  # ``open`` lets D compute the prompt itself
        except UpstreamError as exc:
            err2 = UpstreamError(f"metaserver: {exc.message}")
            raise LegError(err2, self._bindings.base_url, "binding") from exc
        finally:
            self._binding_waits.end(waiting)
        self._binding_hist.observe(time.perf_counter() - t0)
        return raw
