"""ascend-layerwise: decode-first for unchanged vllm-ascend engines (MooncakeLayerwiseConnector).

1. D gets the request with ``{"do_remote_decode": false, "do_remote_prefill": true,
   "metaserver": <the metaserver's /v1/ascend/metaserver URL>}`` and ``X-Request-Id: T`` (the
   attempt's transfer id), so D's requests are ``cmpl-T-<i>`` / ``chatcmpl-T``. At scheduling
   time D's connector POSTs its blocks to that URL; the metaserver vets and stores them as the
   binding of each request id and answers at once.
2. The proxy long-polls every child's binding (the decode-first machinery), then sends P the
   request (max_tokens=1, same ``X-Request-Id``) with D's parameters as ``kv_transfer_params``
   (``pdwire.ascend.ascend_prefill_params``). P pushes KV layer by layer into D's blocks and
   signals D over its own side channel; D decodes and streams.
3. D's failure interrupts the binding wait and P's leg; any failure drops both legs (closing a
   connection aborts the vLLM request) and marks each child's binding ``failed`` (P errored)
   or ``aborted``. A success posts nothing (one metaserver write less per request): its
   binding stays ``bound``. A retry is a new attempt: new T, new ids.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

import msgspec

from pdwire.ascend import ascend_decode_leg, ascend_prefill_params, ascend_request_ids
from pdwire.ascend import binding_of_record as _params_of
from pdwire.models import BindingState
from proxy.backend import LegError
from proxy.errors import BindingTimeout, UpstreamError
from proxy.events import EventSink
from proxy.flows.base import Attempt, Legs, PrefillAnswer, Upstream, prefill_cached
from proxy.flows.bindings import BindingMissing, BindingSource
from proxy.flows.watch import DecodeWatch, answered, drop


class AscendLayerwise:
    name = "ascend-layerwise"
    needs_prefill = True

    def __init__(
        self,
        legs: Legs,
        bindings: BindingSource,
        events: EventSink,
        callback_urls: Callable[[str], str],
    ) -> None:
        self._legs = legs
        self._bindings = bindings
        self._events = events
        self._callback_urls = callback_urls
        self._wait_s = legs.timeouts.binding_wait
        self._grace_s = legs.timeouts.prefill_grace
        self._binding_hist = legs.metrics.binding_wait_seconds

    async def open(self, a: Attempt) -> Upstream:
        ids = ascend_request_ids(a.tid, a.req.chat, a.req.body.get("prompt"))
        a.request_id = a.tid  # vllm-ascend keys the transfer by the engines' request ids
        task = asyncio.current_task()
        assert task is not None
        d_body = a.decode_body(ascend_decode_leg(self._callback_urls(a.tid)))
        d_leg = self._legs.decode(a, d_body, a.leg_span("decode", a.decode.url))
        d_task = asyncio.get_running_loop().create_task(d_leg)
        watch = DecodeWatch(task, self._grace_s)
        d_task.add_done_callback(watch)
        try:
            watch.armed = True
            try:
                params = await self._params(a, ids)
            except asyncio.CancelledError:
                if not watch.absorb():
                    raise
                return self._tracked(await d_task, ids)  # D answered without waiting for KV
            watch.disarm()
            watch.any_end = False
            watch.armed = True
            try:
                assert a.prefill is not None  # its span: the traceparent header only
                p_span = a.leg_span("prefill", a.prefill.url)
                answer: PrefillAnswer = await self._legs.prefill(a, params, p_span)
            except asyncio.CancelledError:
                if not watch.absorb():
                    raise
                if answered(d_task):  # D answered; P not within the grace: its leg dropped
                    self._legs.metrics.prefill_dropped.inc()
                    return self._tracked(d_task.result(), ids)
                await d_task  # raises D's error
                raise
            watch.disarm()
            up = await d_task
        except BaseException as exc:
            watch.disarm()
            drop(d_task)
            failed = isinstance(exc, LegError) and exc.leg == "prefill"
            state = BindingState.FAILED if failed else BindingState.ABORTED
            for rid in ids:
                self._events.abandon(rid, state, str(exc) or type(exc).__name__)
            raise
        up.prefill_cached = prefill_cached(answer)
        return self._tracked(up, ids)

    @staticmethod
    def _tracked(up: Upstream, ids: list[str]) -> Upstream:
        up.binding_tracked = True
        up.binding_ids = tuple(ids)
        return up

    async def _all(self, ids: list[str]) -> list[msgspec.Raw]:
        """A batch's bindings, waited for together; the first failure cancels the rest."""
        loop = asyncio.get_running_loop()
        tasks = [loop.create_task(self._bindings.wait(i, self._wait_s)) for i in ids]
        try:
            return [await t for t in tasks]
        finally:
            for t in tasks:
                if not t.done():
                    t.cancel()
            for t in tasks:  # retrieve what the ones we gave up on raised
                if t.done() and not t.cancelled():
                    t.exception()

    async def _params(self, a: Attempt, ids: list[str]) -> dict[str, Any]:
        """Every child's binding, as P's ``kv_transfer_params``, in a ``binding_wait`` span."""
        span = a.trace.leg("binding_wait", {"pdgate.transfer_id": a.tid})
        try:
            params = await self._wait_params(a, ids)
        except BaseException as exc:
            span.end(exc)
            raise
        span.end()
        return params

    async def _wait_params(self, a: Attempt, ids: list[str]) -> dict[str, Any]:
        t0 = time.perf_counter()
        try:
            if len(ids) == 1:
                raws = [await self._bindings.wait(ids[0], self._wait_s)]
            else:
                raws = await self._all(ids)
        except BindingMissing as exc:
            err = BindingTimeout(f"no binding for {exc} within {self._wait_s}s")
            raise LegError(err, a.decode.url, "binding") from exc
        except UpstreamError as exc:
            err2 = UpstreamError(f"metaserver: {exc.message}")
            raise LegError(err2, self._bindings.base_url, "binding") from exc
        self._binding_hist.observe(time.perf_counter() - t0)
        try:
            found = [_params_of(bytes(raw)) for raw in raws]
        except msgspec.DecodeError as exc:
            err3 = UpstreamError("metaserver answered a binding that is not JSON")
            raise LegError(err3, self._bindings.base_url, "binding") from exc
        return ascend_prefill_params(ids, found)
