"""Prefill side of the scheduler half: which blocks to push each step, and block lifetime.

Each step, for every request pushing to D, the blocks that became complete in this chunk go to
the workers (full blocks only; the tail block on the last chunk; blocks D already has are
skipped). ``finished`` keeps P's blocks (delay-free) until the workers report every push from
them ended. Without a binding yet (concurrent mode), before D's registration is confirmed or
before P's lease on the binding is confirmed, ``matched`` answers ``None``: vLLM skips the
request this step, so it holds no blocks.

The lease: P writes nothing into D's blocks before its compare-and-set ``bound →
prefill_started`` won in the metaserver. D (or the proxy) ending the binding first makes P push
nothing, and lets D free its blocks at once. A lease P took is always closed: a request that
ends before any of its blocks went to the workers hands it to ``LeaseCloser`` (D is told at
once); one that ends mid-push is ended by the workers (``WorkerHalf.transfer_results``).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from connector import tp
from connector.errors import LayoutError
from connector.metadata import Abandoned, Destination, PdgateMetadata, SendChunk
from connector.scheduler.leases import LeaseCloser
from connector.scheduler.lookups import Lookups
from connector.stats import StatsCollector
from connector.tracing import ConnectorTracer, Event, Value
from pdwire.client import BackgroundWriter
from pdwire.compat import instances_problem
from pdwire.errors import ParamsError
from pdwire.models import Binding, BindingState, EventDetail, InstanceSpec
from pdwire.params import SendParams, parse_prefill_leg, push_report
from pdwire.trace import TraceParent
from pdwire.version import mismatch

if TYPE_CHECKING:
    from vllm.v1.core.kv_cache_manager import KVCacheManager
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.request import Request

log = logging.getLogger("pdgate.connector.prefill")


@dataclass
class _Push:
    request: Request
    transfer_id: str
    dest: Destination
    d_blocks: list[int]
    prompt_len: int
    next_block: int  # first block not handed to the workers yet
    emitted: bool = False
    closed: bool = False
    traceparent: str = ""  # handed to the workers with each chunk (tracing on)


@dataclass
class _Trace:
    """A traced request on P (tracing on, the proxy's context sampled)."""

    parent: TraceParent
    start: float  # wall clock: P's scheduler first saw the request
    events: list[Event]


@dataclass
class _Request:
    """What P knows of one request, from the first time it looks at it until ``finished``."""

    params: SendParams | None  # None: the request asked for no push, or asked badly
    push: _Push | None = None  # set up by ``after_alloc``
    no_push: str | None = None  # why P will push nothing for it
    doubted_at: float | None = None  # when the registry first said no (``registry_grace_s``)
    claiming: Binding | None = None  # P asked for the lease on this binding
    claimed: Binding | None = None  # P holds the lease (its ``prefill_started`` won)
    trace: _Trace | None = None


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
        self._tp = tp_size
        self._spec = spec  # this P's registration: its revision and KV identity
        self._stats = stats or StatsCollector()
        self._refused_pairs: set[tuple[str, str]] = set()  # (D instance, why): logged once
        self._tracer = tracer  # tracing on in this engine
        self.refused = 0  # bindings this P cannot serve (block size, TP pairing)
        self._lookups = lookups
        self._block_size = block_size
        self._concurrent = concurrent
        self._events = events
        self._actor = actor
        self._window = push_window_s
        self._wall = wall_clock
        self._clock = clock
        self._grace = registry_grace_s
        self.expired = 0
        self._requests: dict[str, _Request] = {}  # by request id, until ``finished``
        self._manager: KVCacheManager | None = None
        self.untrusted = 0
        self.lost_claims = 0  # transfers ended (aborted, failed) before P could take them
        self.leases = LeaseCloser(lookups, actor)

    def bind(self, manager: KVCacheManager) -> None:
        self._manager = manager

    def _state(self, request: Request) -> _Request:
        """The request's state; its push parameters are parsed (and the binding validated)
        once per request: ``matched`` runs every step while a request waits, ``after_alloc``
        once more."""
        rid = request.request_id
        state = self._requests.get(rid)
        if state is None:
            try:
                state = _Request(parse_prefill_leg(request.kv_transfer_params))
            except ParamsError as exc:
                log.warning("request %s: %s; no push", rid, exc)
                state = _Request(None, no_push=str(exc))
            if self._tracer is not None and state.params is not None:
                tp = state.params.trace
                if tp is not None and tp.sampled:
                    state.trace = _Trace(tp, self._wall(), [])
            self._requests[rid] = state
        return state

    def _push_of(self, req_id: str) -> _Push | None:
        state = self._requests.get(req_id)
        return None if state is None else state.push

    def _binding(self, request: Request, state: _Request) -> tuple[str, Binding | None] | None:
        """(transfer id, binding or None while unknown); ``None``: no push for this request."""
        params = state.params
        if params is None:
            return None
        if params.binding is not None:
            return params.transfer_id, params.binding
        if not self._concurrent:
            log.warning("request %s has no binding and concurrent mode is off", request.request_id)
            state.no_push = "no binding in the request (concurrent mode off)"
            return None
        got = self._lookups.binding(params.transfer_id)
        if isinstance(got, Exception):
            log.warning("binding %s unavailable (%s); no push", params.transfer_id, got)
            state.no_push = f"binding unavailable: {got}"
            return None
        return params.transfer_id, got

    def matched(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        """``None`` (ask again next step; nothing allocated meanwhile) until P knows whether it
        pushes: the binding is known, its decoder vouched for, the pairing workable and the
        lease taken (``bound → prefill_started``)."""
        state = self._state(request)
        if state.push is not None or state.claimed is not None or state.no_push is not None:
            return 0, False
        found = self._binding(request, state)
        if found is None:
            return 0, False
        tid, binding = found
        if binding is None:
            return None, False
        chosen = state.params.decode_instance if state.params is not None else None
        if chosen is not None and binding.decode_instance_id != chosen:
            self.untrusted += 1
            why = f"the binding names {binding.decode_instance_id}, the proxy chose {chosen}"
            log.warning("transfer %s: %s; no push", tid, why)
            state.no_push = why
            return 0, False
        verdict = self._lookups.trusted(binding)
        if verdict is None or (verdict is False and self._still_doubting(request, state, binding)):
            return None, False
        if verdict is False:
            self._distrust(request, state, tid, binding)
            return 0, False
        if self._refuse(state, tid, binding):
            return 0, False
        until = Destination.of(binding, self._window).deadline
        state.claiming = binding
        claim = self._lookups.claim(tid, self._actor, until)
        if claim is None:
            return None, False
        if not claim.won:
            self.lost_claims += 1
            log.info("transfer %s: %s; no push", tid, claim.why)
            state.no_push = claim.why
            return 0, False
        field = None if claim.record is None else claim.record.differs_from(binding)
        if field is not None:  # the request's binding is not the one D wrote
            self.untrusted += 1
            why = f"the request's binding differs from the stored one in {field}"
            log.warning("transfer %s: %s; no push", tid, why)
            state.no_push = why
            if self._events is not None:  # P holds the lease: D is told at once
                detail = EventDetail(error=why)
                self._events.post_event(tid, BindingState.FAILED, self._actor, detail)
            return 0, False
        state.claimed = binding
        return 0, False

    def _still_doubting(self, request: Request, state: _Request, binding: Binding) -> bool:
        """A no from the registry is re-asked for ``registry_grace_s`` before it is final: a
        decoder whose heartbeat lapsed (a starved host, a metaserver restart) is back within
        a beat or two, and refusing means D waits out its whole load deadline."""
        now = self._clock()
        if state.doubted_at is None:
            state.doubted_at = now
        since = state.doubted_at
        if now - since >= self._grace:
            return False
        if since == now and self._grace > 0:
            log.info(
                "request %s: the registry does not vouch for %s at %s; asking again for up to "
                "%.0fs before pushing nothing",
                request.request_id,
                binding.decode_instance_id,
                binding.kv_endpoint,
                self._grace,
            )
        return True

    def _distrust(self, request: Request, state: _Request, tid: str, binding: Binding) -> None:
        doubted = state.doubted_at
        self.untrusted += 1
        log.warning(
            "transfer %s names %s at %s, which the registry does not vouch for%s; no push",
            tid,
            binding.decode_instance_id,
            binding.kv_endpoint,
            "" if doubted is None else f" (asked for {self._clock() - doubted:.1f}s)",
        )
        state.no_push = (
            f"the registry does not vouch for {binding.decode_instance_id} at "
            f"{binding.kv_endpoint.host}:{binding.kv_endpoint.port}"
        )

    def _refuse(self, state: _Request, tid: str, binding: Binding) -> bool:
        """Whether P must not take this transfer (checked before the lease, so that a refusal
        leaves the binding unclaimed and D free to drop its blocks at once: the proxy, told by
        P's answer, ends it)."""
        deadline = Destination.of(binding, self._window).deadline
        if deadline and self._wall() >= deadline:
            self.expired += 1
            log.warning("transfer %s: D's load deadline already passed; no push", tid)
            state.no_push = "D's load deadline already passed"
            return True
        reason, problem = self._pairing(binding)
        if problem is None:
            return False
        # refused here, the worker never meets a pairing it cannot route
        self.refused += 1
        self._stats.add("pairing_refusals", label=reason)
        pair = (binding.decode_instance_id, problem)
        if pair not in self._refused_pairs:  # once per D and reason, not per request
            self._refused_pairs.add(pair)
            log.error(
                "transfer %s: %s; no push to %s (logged once; counted in pairing_refusals)",
                tid,
                problem,
                binding.decode_instance_id,
            )
        else:
            log.debug("transfer %s: %s; no push", tid, problem)
        # P's answer says why (push: none); nothing is posted on the binding, which P has not
        # taken (the metaserver answers 403 to a failed event from anyone but the lease's holder)
        state.no_push = problem
        return True

    def _pairing(self, binding: Binding) -> tuple[str, str | None]:
        """(reason, problem) when P must not push into ``binding``'s D; problem ``None``: it
        may. D's registration (the registry already vouched for it) gives its revision and
        KV identity."""
        problem = mismatch(binding.protocol, f"D {binding.decode_instance_id}")
        if problem is not None:
            return "protocol", problem
        if binding.block_size != self._block_size:
            return "layout", f"D block size {binding.block_size} != P block size {self._block_size}"
        try:
            tp.check_pairing(self._tp, binding.tp_size, binding.num_kv_heads, binding.use_mla)
        except LayoutError as exc:
            return "layout", str(exc)
        d = self._lookups.instance(binding.decode_instance_id)
        if self._spec is None or d is None:
            return "", None
        found = instances_problem(self._spec, d)
        if found is None:
            return "", None
        return found.reason, f"D {binding.decode_instance_id} cannot use P's KV: {found.text}"

    def after_alloc(self, request: Request) -> None:
        state = self._state(request)
        binding = state.claimed
        if state.push is not None or binding is None or state.params is None:
            return
        tid = state.params.transfer_id
        dest = Destination.of(binding, self._window)
        if dest.deadline and self._wall() >= dest.deadline:
            self.expired += 1
            log.warning("transfer %s: D's load deadline passed while P waited; no push", tid)
            state.no_push = "D's load deadline already passed"
            return
        state.push = _Push(
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
                self._close(meta, push, [], fail="prefill preempted")
        for req_id, count in out.num_scheduled_tokens.items():
            push = self._push_of(req_id)
            if push is None or push.closed:
                continue
            end = push.request.num_computed_tokens + count
            last = end >= push.prompt_len
            bs = self._block_size
            upto = -(-push.prompt_len // bs) if last else end // bs
            assert self._manager is not None
            p_blocks = self._manager.get_block_ids(req_id)[0]
            upto = min(upto, len(push.d_blocks), len(p_blocks))
            pairs = [(p_blocks[i], push.d_blocks[i]) for i in range(push.next_block, upto)]
            push.next_block = max(push.next_block, upto)
            if not push.emitted and push.traceparent:
                self._traced(req_id, "prefill_started", {"pdgate.scheduled_tokens": count})
            if last:
                self._close(meta, push, pairs)
            elif pairs:
                meta.sends.append(
                    SendChunk(
                        req_id, push.transfer_id, push.dest, pairs, False, "", push.traceparent
                    )
                )
                push.emitted = True

    def _close(
        self, meta: PdgateMetadata, push: _Push, pairs: list[tuple[int, int]], fail: str = ""
    ) -> None:
        rid = push.request.request_id
        chunk = SendChunk(rid, push.transfer_id, push.dest, pairs, True, fail, push.traceparent)
        meta.sends.append(chunk)
        push.emitted = True
        push.closed = True

    def finished(self, request: Request) -> tuple[bool, dict[str, Any] | None]:
        """Whether to delay freeing the request's blocks (the workers report when to free), and
        the push report for P's answer (``None`` for requests that asked for no push)."""
        state = self._requests.pop(request.request_id, None)
        if state is None:  # ``matched`` never saw it (aborted while waiting)
            state = _Request(_parse_quietly(request))
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
            self._finish_trace(request, state.trace, out[1])
        return out

    def _end_lease(self, tid: str, state: _Request) -> None:
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

    def _finish_trace(self, request: Request, trace: _Trace, report: dict[str, Any] | None) -> None:
        """The ``pdgate.connector.prefill`` span: first seen → finished, with the report."""
        assert self._tracer is not None
        attributes: dict[str, str | int] = {
            "pdgate.request_id": request.request_id,
            "pdgate.prompt_tokens": len(request.prompt_token_ids or ()),
        }
        if report is not None:
            attributes["pdgate.transfer_id"] = str(report.get("transfer_id") or "")
            attributes["pdgate.push"] = str(report.get("push", ""))
            if report.get("reason"):
                attributes["pdgate.no_push_reason"] = str(report["reason"])
        end = self._wall()
        trace.events.append(Event("finished", end))
        self._tracer.emit(
            "pdgate.connector.prefill", trace.parent, trace.start, end, attributes, trace.events
        )


def _parse_quietly(request: Request) -> SendParams | None:
    """For a request ``matched`` never saw (aborted while waiting)."""
    try:
        return parse_prefill_leg(request.kv_transfer_params)
    except ParamsError:
        return None
