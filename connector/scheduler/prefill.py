"""Prefill side of the scheduler half: which blocks to push each step, and block lifetime.

Each step, for every request pushing to D, the blocks that became complete in this chunk go to
the workers (``Push.step``, pushes.py). ``finished`` keeps P's blocks (delay-free) until the
workers report every push from them ended. Without a binding yet (concurrent mode), before D's
registration is confirmed or before P's lease on the binding is confirmed, ``matched`` answers
``None`` (admission.py): vLLM skips the request this step, so it holds no blocks.

The lease: P writes nothing into D's blocks before its compare-and-set ``bound →
prefill_started`` won in the metaserver. D (or the proxy) ending the binding first makes P push
nothing, and lets D free its blocks at once. A lease P took is always closed: a request that
ends before any of its blocks went to the workers hands it to ``LeaseCloser`` (D is told at
once); one that ends mid-push is ended by the workers (``WorkerHalf.transfer_results``).

Runs in vLLM's EngineCore process, on its scheduler's thread (``ConnectorScheduler``).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from connector.metadata import Abandoned, Destination, PdgateMetadata
from connector.scheduler.admission import Admission
from connector.scheduler.leases import LeaseCloser
from connector.scheduler.lookups import Lookups
from connector.scheduler.pushes import PrefillRequest, PrefillTrace, Push, parse_quietly
from connector.stats import StatsCollector
from connector.tracing import ConnectorTracer, Event, Value
from pdwire.client import BackgroundWriter
from pdwire.errors import ParamsError
from pdwire.models import InstanceSpec
from pdwire.params import parse_prefill_leg, push_report

if TYPE_CHECKING:
    from vllm.v1.core.kv_cache_manager import KVCacheManager
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.request import Request

log = logging.getLogger("pdgate.connector.prefill")


class PrefillSide:
    def __init__(
        self,
        lookups: Lookups,
        block_size: int,
        *,
        concurrent: bool,
        events: BackgroundWriter | None,
        actor: str,
        push_window_s: float = 0.0,
        registry_grace_s: float = 0.0,
        wall_clock: Callable[[], float] = time.time,
        clock: Callable[[], float] = time.monotonic,
        tp_size: int = 1,
        tracer: ConnectorTracer | None = None,
        spec: InstanceSpec | None = None,
        stats: StatsCollector | None = None,
    ) -> None:
        self._admission = Admission(
            lookups,
            block_size,
            concurrent=concurrent,
            events=events,
            actor=actor,
            push_window_s=push_window_s,
            registry_grace_s=registry_grace_s,
            wall_clock=wall_clock,
            clock=clock,
            tp_size=tp_size,
            spec=spec,
            stats=stats,
        )
        self._tracer = tracer  # tracing on in this engine
        self._lookups = lookups
        self._block_size = block_size
        self._window = push_window_s
        self._wall = wall_clock
        self._requests: dict[str, PrefillRequest] = {}  # by request id, until ``finished``
        self._manager: KVCacheManager | None = None
        self.leases = LeaseCloser(lookups, actor)

    # ---- what admission counted ------------------------------------------------------------
    @property
    def refused(self) -> int:
        """Bindings this P cannot serve (block size, TP pairing)."""
        return self._admission.refused

    @property
    def expired(self) -> int:
        """Transfers whose D load deadline passed before P could push."""
        return self._admission.expired

    @property
    def untrusted(self) -> int:
        return self._admission.untrusted

    @property
    def lost_claims(self) -> int:
        """Transfers ended (aborted, failed) before P could take them."""
        return self._admission.lost_claims

    def bind(self, manager: KVCacheManager) -> None:
        self._manager = manager

    def _state(self, request: Request) -> PrefillRequest:
        """The request's state; its push parameters are parsed (and the binding validated)
        once per request: ``matched`` runs every step while a request waits, ``after_alloc``
        once more."""
        rid = request.request_id
        state = self._requests.get(rid)
        if state is None:
            try:
                state = PrefillRequest(parse_prefill_leg(request.kv_transfer_params))
            except ParamsError as exc:
                log.warning("request %s: %s; no push", rid, exc)
                state = PrefillRequest(None, no_push=str(exc))
            if self._tracer is not None and state.params is not None:
                tp = state.params.trace
                if tp is not None and tp.sampled:
                    state.trace = PrefillTrace(tp, self._wall(), [])
            self._requests[rid] = state
        return state

    def _push_of(self, req_id: str) -> Push | None:
        state = self._requests.get(req_id)
        return None if state is None else state.push

    def matched(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        """``None`` (ask again next step; nothing allocated meanwhile) until P knows whether it
        pushes: the binding is known, its decoder vouched for, the pairing workable and the
        lease taken (``bound → prefill_started``)."""
        state = self._state(request)
        if state.push is not None or state.claimed is not None or state.no_push is not None:
            return 0, False
        return (0 if self._admission.decide(request, state) else None), False

    def after_alloc(self, request: Request) -> None:
        state = self._state(request)
        binding = state.claimed
        if state.push is not None or binding is None or state.params is None:
            return
        tid = state.params.transfer_id
        dest = Destination.of(binding, self._window)
        if self._admission.expired_meanwhile(state, tid, dest):
            return
        state.push = Push(
            request=request,
            transfer_id=tid,
            dest=dest,
            d_blocks=list(binding.block_ids[0]),
            prompt_len=len(request.prompt_token_ids or ()),
            next_block=binding.num_cached_tokens // self._block_size,
        )
        if state.trace is not None:
            state.push.traceparent = state.trace.parent.header()
            attributes: dict[str, Value] = {
                "pdgate.decode_instance": binding.decode_instance_id,
                "pdgate.d_blocks": len(binding.block_ids[0]),
                "pdgate.d_cached_tokens": binding.num_cached_tokens,
            }
            state.trace.events.append(Event("push_set_up", self._wall(), attributes))

    def fill(self, meta: PdgateMetadata, out: SchedulerOutput) -> None:
        self.leases.fill(meta)
        for req_id in out.preempted_req_ids or ():
            push = self._push_of(req_id)
            if push is not None and not push.closed:
                meta.sends.append(push.close([], fail="prefill preempted"))
        for req_id, count in out.num_scheduled_tokens.items():
            push = self._push_of(req_id)
            if push is None or push.closed:
                continue
            assert self._manager is not None
            if not push.emitted and push.traceparent:
                self._traced(req_id, "prefill_started", {"pdgate.scheduled_tokens": count})
            chunk = push.step(count, self._manager.get_block_ids(req_id)[0], self._block_size)
            if chunk is not None:
                meta.sends.append(chunk)

    def finished(self, request: Request) -> tuple[bool, dict[str, Any] | None]:
        """Whether to delay freeing the request's blocks (the workers report when to free), and
        the push report for P's answer (``None`` for requests that asked for no push)."""
        state = self._requests.pop(request.request_id, None)
        if state is None:  # ``matched`` never saw it (aborted while waiting)
            state = PrefillRequest(parse_quietly(request))
        push = state.push
        if push is not None and push.emitted:  # the workers end it (and report when settled)
            self._lookups.forget_binding(push.transfer_id)
            out = True, push_report(push.transfer_id, None)
        else:
            params, why = state.params, state.no_push
            if params is None and why is None:
                return False, None
            tid = params.transfer_id if params is not None else None
            if tid is not None:
                self._end_lease(tid, state)
            out = (
                False,
                push_report(tid, None if push else why or "finished before a push was set up"),
            )
        if state.trace is not None:
            assert self._tracer is not None
            state.trace.emit(self._tracer, request, out[1], self._wall())
        return out

    def _end_lease(self, tid: str, state: PrefillRequest) -> None:
        """The request ended before any of its blocks went to the workers: a lease P holds
        (or may have won: the claim's answer not read yet) is closed, so D is told."""
        binding = state.claimed or state.claiming
        if binding is None or (state.claimed is None and state.no_push is not None):
            self._lookups.forget_binding(tid)  # no lease: nothing to tell D
            return
        trace = "" if state.trace is None else state.trace.parent.header()
        lease = Abandoned(tid, Destination.of(binding, self._window), trace)
        if state.claimed is not None:
            self._lookups.forget_binding(tid)
            self.leases.close(lease)
        else:
            self.leases.watch(lease)

    def _traced(self, req_id: str, name: str, attributes: dict[str, str | int]) -> None:
        state = self._requests.get(req_id)
        if state is not None and state.trace is not None:
            state.trace.events.append(Event(name, self._wall(), attributes))
