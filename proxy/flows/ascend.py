"""ascend-layerwise: decode-first for unchanged vllm-ascend engines (MooncakeLayerwiseConnector).

1. D gets the request with ``{"do_remote_decode": false, "do_remote_prefill": true,
   "metaserver": <the metaserver's /v1/ascend/metaserver URL>}`` and ``X-Request-Id: T`` (the
   attempt's transfer id), so D's requests are ``cmpl-T-<i>`` / ``chatcmpl-T``. At scheduling
   time D's connector POSTs its blocks to that URL; the metaserver vets and stores them as the
   binding of each request id and answers at once.
2. The proxy long-polls every child's binding (the decode-first walk, ``proxy.flows.walk``,
   with none of its fallbacks), then sends P the
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
from collections.abc import Callable
from typing import Any

import msgspec

from pdwire.ascend import ascend_decode_leg, ascend_prefill_params, ascend_request_ids
from pdwire.ascend import binding_of_record as _params_of
from proxy.backend import LegError
from proxy.errors import BindingTimeout, MetaserverUnavailable, UpstreamError
from proxy.events import EventSink
from proxy.flows.base import Attempt, Legs, Upstream
from proxy.flows.bindings import BindingMissing, BindingSource
from proxy.flows.walk import NONE, Walk


class AscendLayerwise:
    name = "ascend-layerwise"
    needs_prefill = True
    fallbacks = NONE  # vllm-ascend's D waits for KV whatever P answers: any failure fails
    waits = True

    def __init__(
        self,
        legs: Legs,
        bindings: BindingSource,
        events: EventSink,
        callback_urls: Callable[[str], str],
    ) -> None:
        self._walk = Walk(legs, bindings, events)
        self._bindings = bindings
        self._callback_urls = callback_urls
        self._wait_s = legs.timeouts.binding_wait

    async def open(self, a: Attempt) -> Upstream:
        return await self._walk.run(a, self)

    def begin(self, a: Attempt) -> tuple[str, ...]:
        a.request_id = a.tid  # vllm-ascend keys the transfer by the engines' request ids
        return tuple(ascend_request_ids(a.tid, a.req.chat, a.req.body.get("prompt")))

    def decode_params(self, a: Attempt, traceparent: str | None) -> dict[str, Any]:
        return ascend_decode_leg(self._callback_urls(a.tid))  # the header carries the trace

    def foreign(self, a: Attempt, binding: Any) -> str | None:
        return None  # the metaserver vets D's post against the decode pool itself

    def prefill_params(
        self, a: Attempt, binding: list[Any], ids: tuple[str, ...], traceparent: str | None
    ) -> dict[str, Any]:
        return ascend_prefill_params(list(ids), binding)

    async def binding(self, a: Attempt, ids: tuple[str, ...]) -> list[Any]:
        """Every child's binding, read as P's parameters."""
        try:
            if len(ids) == 1:
                raws = [await self._bindings.wait(ids[0], self._wait_s)]
            else:
                raws = await self._all(ids)
        except BindingMissing as exc:
            err = BindingTimeout(f"no binding for {exc} within {self._wait_s}s")
            raise LegError(err, a.decode.url, "binding") from exc
        except MetaserverUnavailable:
            raise
        except UpstreamError as exc:
            err2 = UpstreamError(f"metaserver: {exc.message}")
            raise LegError(err2, self._bindings.base_url, "binding") from exc
        try:
            return [_params_of(bytes(raw)) for raw in raws]
        except msgspec.DecodeError as exc:
            err3 = UpstreamError("metaserver answered a binding that is not JSON")
            raise LegError(err3, self._bindings.base_url, "binding") from exc

    async def _all(self, ids: tuple[str, ...]) -> list[msgspec.Raw]:
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
