"""The decode-first walk of one attempt, shared by decode-first, concurrent and ascend-layerwise.

1. D's leg runs in a task of its own, with the parameters that make D wait for remote KV.
2. Unless the flow sends P at once, the request's task waits for D's binding(s) (one
   ``pdgate.binding_wait`` span, ``pd_binding_wait_seconds``); D ending meanwhile interrupts the
   wait (cancel + ``uncancel``: ``DecodeWatch``) and D's answer is the attempt's.
3. P's leg, with the binding(s) as its parameters: D's failure interrupts it at once, D's answer
   after the grace (P's report may still come; a P that hangs must not hold D's answer).
   When P answers first and the request takes it (``Attempt.early``), P's first token goes to
   the client at once (``proxy.early``); D's stream follows without it.
4. Any failure drops the other leg (closing D's connection aborts its request, so nothing waits
   for KV that will never come) and marks each binding ``failed`` (P's leg failed) or
   ``aborted`` (anything else), fire-and-forget.

A flow supplies a ``Plan``: D's and P's parameters, the wait for the binding(s), the ids it marks,
and, stated explicitly in ``Fallbacks``, when D gets the plain request and computes the prompt
itself instead of failing the attempt.
"""

from __future__ import annotations

import asyncio
import enum
import logging
import time
from dataclasses import dataclass
from typing import Any, Protocol

from pdwire.models import BindingState, MarkKind
from proxy.backend import LegError
from proxy.errors import MetaserverUnavailable, UpstreamError
from proxy.events import EventSink
from proxy.flows.base import Attempt, Legs, PrefillAnswer, Upstream, no_push_reason, prefill_cached
from proxy.flows.bindings import BindingSource
from proxy.flows.watch import DecodeWatch, answered, drop

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


@dataclass(frozen=True)
class Fallbacks:
    """When D computes the prompt itself instead of the attempt failing (each ``Without``)."""

    unreadable: bool = False  # the metaserver could not give the binding (D needs none)
    foreign: bool = False  # the binding names another D than the chosen one
    no_push: bool = False  # P answered that it pushed nothing
    p_failed: bool = False  # P's leg broke after P took the binding (read back once)
    mismatch: bool = False  # P's first token and D's differ (``proxy.integrity``)


NONE = Fallbacks()


class Plan(Protocol):
    """What a decode-first flow supplies; each method gets the attempt it is for."""

    fallbacks: Fallbacks
    waits: bool  # False: P is sent at once, without the binding (its connector fetches it)

    def begin(self, a: Attempt) -> tuple[str, ...]:
        """Set ``a`` up for this flow; the ids of the bindings it makes (marked on failure,
        tracked on success)."""
        ...

    def decode_params(self, a: Attempt, traceparent: str | None) -> dict[str, Any]: ...

    async def binding(self, a: Attempt, ids: tuple[str, ...]) -> Any:
        """D's binding(s) as P's flow needs them; raises ``LegError`` (leg ``binding``), or
        ``MetaserverUnavailable`` when the metaserver could not answer."""
        ...

    def foreign(self, a: Attempt, binding: Any) -> str | None:
        """Why ``binding`` is not the chosen D's (``None``: it is)."""
        ...

    def prefill_params(
        self, a: Attempt, binding: Any, ids: tuple[str, ...], traceparent: str | None
    ) -> dict[str, Any]: ...


class Walk:
    def __init__(self, legs: Legs, bindings: BindingSource, events: EventSink) -> None:
        self._legs = legs
        self._bindings = bindings
        self._events = events
        self._grace_s = legs.timeouts.prefill_grace
        self._binding_hist = legs.metrics.binding_wait_seconds
        self._binding_waits = legs.metrics.binding_waits

    async def run(self, a: Attempt, plan: Plan) -> Upstream:
        ids = plan.begin(a)
        fall = plan.fallbacks
        binding: Any = None
        task = asyncio.current_task()
        assert task is not None
        d_span = a.leg_span("decode", a.decode.url)
        d_leg = self._legs.decode(
            a, a.decode_body(plan.decode_params(a, d_span.traceparent)), d_span
        )
        d_task = asyncio.get_running_loop().create_task(d_leg)
        watch = DecodeWatch(task, self._grace_s)
        d_task.add_done_callback(watch)
        try:
            if plan.waits:
                watch.armed = True
                try:
                    binding = await self._binding(a, plan, ids)
                except asyncio.CancelledError:
                    if not watch.absorb():
                        raise
                    return await d_task  # D answered (or failed) without waiting for KV
                watch.disarm()
                foreign = plan.foreign(a, binding) if fall.foreign else None
                if foreign is not None:
                    return await self._decode_alone(a, ids, d_task, foreign, Without.FOREIGN)
            # from now on D's failure interrupts P at once, D's answer after the grace (a D
            # that ended since the binding came has its callback pending: it runs armed, at
            # P's leg's first await)
            watch.any_end = False
            watch.armed = True
            try:
                answer = await self._prefill(a, plan, binding, ids)
            except asyncio.CancelledError:
                if not watch.absorb():
                    raise
                if answered(d_task):
                    return self._without_prefill(a, ids, d_task.result())
                await d_task  # raises D's error
                raise
            watch.disarm()
            if a.early is not None and not answered(d_task):
                await a.early.offer(answer)  # the client's first token: P's, D's to follow
            why = no_push_reason(answer) if fall.no_push else None
            if why is None or answered(d_task):
                up = await d_task
        except BaseException as exc:
            watch.disarm()
            if fall.unreadable and isinstance(exc, MetaserverUnavailable) and not d_task.done():
                return await self._decode_alone(a, ids, d_task, exc.message, Without.UNREADABLE)
            if fall.p_failed and await self._p_failed_after_taking(a, ids, d_task, exc):
                assert isinstance(exc, LegError)
                up = await self._decode_alone(a, ids, d_task, exc.message, Without.P_FAILED)
                up.prefill_error = exc  # the dispatcher charges P as for a failed attempt
                return up
            drop(d_task)
            failed = isinstance(exc, LegError) and exc.leg == "prefill"
            self._abandon(ids, BindingState.FAILED if failed else BindingState.ABORTED, exc)
            raise
        if why is not None and not answered(d_task):
            return await self._decode_alone(a, ids, d_task, why, Without.NO_PUSH)
        up.prefill_cached = prefill_cached(answer)
        _tracked(up, ids)
        if not fall.mismatch:
            return up
        try:
            differ = await self._legs.first_tokens_differ(a, answer, up)
        except BaseException as exc:
            self._abandon(ids, BindingState.ABORTED, exc)
            raise
        if differ is not None:
            for bid in ids:
                self._events.mark(bid, MarkKind.CORRUPT, None, differ[:64])
            return await self._decode_alone(a, ids, d_task, differ, Without.MISMATCH)
        return up

    async def _binding(self, a: Attempt, plan: Plan, ids: tuple[str, ...]) -> Any:
        """The plan's wait in its span, counted; the metaserver being unreachable fails the
        attempt unless the plan lets D compute alone."""
        span = a.trace.leg("binding_wait", {"pdgate.transfer_id": a.tid})
        t0 = time.perf_counter()
        waiting = self._binding_waits.start()
        try:
            binding = await plan.binding(a, ids)
        except MetaserverUnavailable as exc:
            span.end(exc)
            if plan.fallbacks.unreadable:
                raise
            err = UpstreamError(f"metaserver: {exc.message}")
            raise LegError(err, self._bindings.base_url, "binding") from exc
        except BaseException as exc:
            span.end(exc)
            raise
        finally:
            self._binding_waits.end(waiting)
        span.end()
        self._binding_hist.observe(time.perf_counter() - t0)
        return binding

    async def _prefill(
        self, a: Attempt, plan: Plan, binding: Any, ids: tuple[str, ...]
    ) -> PrefillAnswer:
        assert a.prefill is not None
        span = a.leg_span("prefill", a.prefill.url)
        params = plan.prefill_params(a, binding, ids, span.traceparent)
        return await self._legs.prefill(a, params, span)

    async def _p_failed_after_taking(
        self, a: Attempt, ids: tuple[str, ...], d_task: asyncio.Task[Upstream], exc: BaseException
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
            self._abandon(ids, BindingState.FAILED, exc)
            raise

    def _without_prefill(self, a: Attempt, ids: tuple[str, ...], up: Upstream) -> Upstream:
        """D answered and P did not within the grace: P's leg was cancelled (its request
        aborted); D's answer goes out without P's report or cached-token count."""
        log.warning(
            "%s: D answered; P's answer not in %.1fs later, its leg dropped", a.tid, self._grace_s
        )
        self._legs.metrics.prefill_dropped.inc()
        return _tracked(up, ids)

    async def _decode_alone(
        self,
        a: Attempt,
        ids: tuple[str, ...],
        d_task: asyncio.Task[Upstream],
        why: str,
        without: Without,
    ) -> Upstream:
        """D's leg is dropped and D gets the plain request (``why`` says what went wrong)."""
        drop(d_task)
        what = _WITHOUT[without]
        log.warning("%s: %s (%s); D computes the prompt itself", a.tid, what, why)
        self._legs.metrics.without_prefill.labels(reason=without.value).inc()
        if without is Without.NO_PUSH:
            self._legs.metrics.no_push.inc()
        why = f"{what}: {why}"
        for bid in ids:
            self._events.abandon(bid, BindingState.FAILED, why)
        span = a.leg_span("decode", a.decode.url)
        span.set("pdgate.without_prefill", why)
        up = await self._legs.decode(a, a.decode_body(None), span)
        # the failed binding's timeline gets D's first token and end
        return _tracked(up, ids)

    def _abandon(self, ids: tuple[str, ...], state: BindingState, exc: BaseException) -> None:
        why = str(exc) or type(exc).__name__
        for bid in ids:
            self._events.abandon(bid, state, why)


def _tracked(up: Upstream, ids: tuple[str, ...]) -> Upstream:
    up.binding_tracked = True
    up.binding_ids = ids
    return up
