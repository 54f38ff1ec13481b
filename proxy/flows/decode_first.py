"""decode-first with a metaserver binding (the layerwise push flow).

1. D gets the request with ``{do_remote_prefill, transfer_id, metaserver}``; its connector
   allocates blocks and writes the binding.
2. The proxy long-polls the binding, then sends P the prefill request carrying it (``decode``);
   P pushes KV into D's blocks and signals D. *Concurrent* mode sends P at once, without the
   binding: P's connector fetches it itself.
3. Both legs are awaited together; the first failure cancels the other leg (closing D's
   connection aborts its request, so nothing waits for KV that will never come) and the binding
   is marked ``failed`` (P errored) or ``aborted`` (anything else), fire-and-forget.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from metaserver.client import AsyncMetaserverClient, MetaserverClientError, NotFoundError
from metaserver.models import BindingState
from proxy.backend import LegError
from proxy.errors import BindingTimeout, UpstreamError
from proxy.events import EventSink
from proxy.flows.base import Attempt, Legs, Upstream, prefill_cached


class DecodeFirst:
    needs_prefill = True

    def __init__(
        self,
        legs: Legs,
        metaserver: AsyncMetaserverClient,
        events: EventSink,
        *,
        concurrent: bool = False,
    ) -> None:
        self._legs = legs
        self._ms = metaserver
        self._events = events
        self._concurrent = concurrent
        self.name = "concurrent" if concurrent else "decode-first"

    async def open(self, a: Attempt) -> Upstream:
        url = self._ms.base_url
        d_kv = {"do_remote_prefill": True, "transfer_id": a.tid, "metaserver": url}
        p_kv: dict[str, Any] = {"do_remote_decode": True, "transfer_id": a.tid, "metaserver": url}
        loop = asyncio.get_running_loop()
        d_task = loop.create_task(self._legs.decode(a, a.req.for_decode(d_kv)))
        p_task: asyncio.Task[dict[str, Any]] | None = None
        try:
            if self._concurrent:
                p_task = loop.create_task(self._legs.prefill(a, p_kv))
            else:
                binding = await self._binding(a, d_task)
                if binding is None:  # D answered without waiting for KV: nothing to prefill
                    return d_task.result()
                p_kv["decode"] = binding
                p_task = loop.create_task(self._legs.prefill(a, p_kv))
            done, _ = await asyncio.wait((d_task, p_task), return_when=asyncio.FIRST_EXCEPTION)
            for task in done:
                exc = task.exception()
                if exc is not None:
                    raise exc
            answer = await p_task
            up = await d_task
        except BaseException as exc:
            _cancel(d_task, p_task)
            failed = isinstance(exc, LegError) and exc.leg == "prefill"
            state = BindingState.FAILED if failed else BindingState.ABORTED
            self._events.post(a.tid, state, str(exc) or type(exc).__name__)
            raise
        up.prefill_cached = prefill_cached(answer)
        up.binding_tracked = True
        return up

    async def _binding(self, a: Attempt, d_task: asyncio.Task[Upstream]) -> dict[str, Any] | None:
        t0 = time.perf_counter()
        wait = self._legs.timeouts.binding_wait
        b_task = asyncio.get_running_loop().create_task(self._ms.get_binding(a.tid, wait=wait))
        try:
            done, _ = await asyncio.wait((b_task, d_task), return_when=asyncio.FIRST_COMPLETED)
        except BaseException:
            b_task.cancel()
            raise
        if b_task not in done:
            b_task.cancel()
            d_task.result()  # raises D's error
            return None
        try:
            binding = b_task.result()
        except NotFoundError as exc:
            err = BindingTimeout(f"no binding for {a.tid} within {wait}s")
            raise LegError(err, a.decode.url, "binding") from exc
        except MetaserverClientError as exc:
            err2 = UpstreamError(f"metaserver: {exc}")
            raise LegError(err2, self._ms.base_url, "binding") from exc
        self._legs.metrics.binding_wait_seconds.observe(time.perf_counter() - t0)
        return binding.model_dump(mode="json")


def _cancel(*tasks: asyncio.Task[Any] | None) -> None:
    """Cancel what still runs; close a D answer that already came; retrieve every error."""
    for task in tasks:
        if task is None:
            continue
        if not task.done():
            task.cancel()
        elif not task.cancelled() and task.exception() is None:
            result = task.result()
            if isinstance(result, Upstream):
                result.close()
