"""Whether P pushes a request's KV, decided before vLLM allocates it any block.

``Admission.decide`` answers "not yet" (vLLM skips the request this step, so it holds no
blocks) until P knows: the binding is known (in concurrent mode P may see the request first:
it is fetched in the background, lookups.py), the decode instance it names is the one the proxy
chose, the registry vouches for it (a no is asked again for ``registry_grace_s``: a decoder
whose heartbeat lapsed is back within a beat or two), D's load deadline has not passed, the
pairing is workable (protocol version, block size, TP and KV heads, the instances'
compatibility), and P won the lease: its compare-and-set ``bound → prefill_started`` in the
metaserver. D (or the proxy) ending the binding first makes P push nothing. Every no is kept on
the request (``no_push``) for P's answer to say why.

Runs in vLLM's EngineCore process, on its scheduler's thread (``PrefillSide.matched``).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, NamedTuple

from connector import tp
from connector.errors import LayoutError
from connector.metadata import Destination
from connector.scheduler.lookups import Lookups
from connector.scheduler.pushes import PrefillRequest
from connector.stats import StatsCollector
from pdwire.client import BackgroundWriter
from pdwire.compat import instances_problem
from pdwire.models import Binding, BindingState, EventDetail, InstanceSpec
from pdwire.version import mismatch

if TYPE_CHECKING:
    from vllm.v1.request import Request

log = logging.getLogger("pdgate.connector.prefill")


class Found(NamedTuple):
    """A request's transfer and its binding (``None`` while it is being fetched)."""

    transfer_id: str
    binding: Binding | None


class Refusal(NamedTuple):
    """Why P must not push into a binding's D: a ``pairing_refusals`` label, and the text."""

    reason: str
    problem: str


class Admission:
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
        spec: InstanceSpec | None = None,
        stats: StatsCollector | None = None,
    ) -> None:
        self._lookups = lookups
        self._block_size = block_size
        self._concurrent = concurrent
        self._events = events
        self._actor = actor
        self._window = push_window_s
        self._grace = registry_grace_s
        self._wall = wall_clock
        self._clock = clock
        self._tp = tp_size
        self._spec = spec  # this P's registration: its revision and KV identity
        self._stats = stats or StatsCollector()
        self._refused_pairs: set[tuple[str, str]] = set()  # (D instance, why): logged once
        self.refused = 0  # bindings this P cannot serve (block size, TP pairing)
        self.expired = 0  # D's load deadline passed before P could push
        self.untrusted = 0
        self.lost_claims = 0  # transfers ended (aborted, failed) before P could take them

    def decide(self, request: Request, state: PrefillRequest) -> bool:
        """False: ask again next step (nothing allocated meanwhile). True: decided, P holds the
        lease (``state.claimed``) or pushes nothing (``state.no_push``)."""
        found = self._binding(request, state)
        if found is None:
            return True
        tid, binding = found
        if binding is None:
            return False
        chosen = state.params.decode_instance if state.params is not None else None
        if chosen is not None and binding.decode_instance_id != chosen:
            self.untrusted += 1
            why = f"the binding names {binding.decode_instance_id}, the proxy chose {chosen}"
            log.warning("transfer %s: %s; no push", tid, why)
            state.no_push = why
            return True
        verdict = self._lookups.trusted(binding)
        if verdict is None or (verdict is False and self._still_doubting(request, state, binding)):
            return False
        if verdict is False:
            self._distrust(state, tid, binding)
            return True
        if self._refuse(state, tid, binding):
            return True
        until = Destination.of(binding, self._window).deadline
        state.claiming = binding
        claim = self._lookups.claim(tid, self._actor, until)
        if claim is None:
            return False
        if not claim.won:
            self.lost_claims += 1
            log.info("transfer %s: %s; no push", tid, claim.why)
            state.no_push = claim.why
            return True
        field = None if claim.record is None else claim.record.differs_from(binding)
        if field is not None:  # the request's binding is not the one D wrote
            self.untrusted += 1
            why = f"the request's binding differs from the stored one in {field}"
            log.warning("transfer %s: %s; no push", tid, why)
            state.no_push = why
            if self._events is not None:  # P holds the lease: D is told at once
                detail = EventDetail(error=why)
                self._events.post_event(tid, BindingState.FAILED, self._actor, detail)
            return True
        state.claimed = binding
        return True

    def expired_meanwhile(self, state: PrefillRequest, tid: str, dest: Destination) -> bool:
        """Whether D's load deadline passed while P waited for blocks (no push then)."""
        if dest.deadline and self._wall() >= dest.deadline:
            self.expired += 1
            log.warning("transfer %s: D's load deadline passed while P waited; no push", tid)
            state.no_push = "D's load deadline already passed"
            return True
        return False

    def _binding(self, request: Request, state: PrefillRequest) -> Found | None:
        """The request's transfer and binding; ``None``: no push for this request."""
        params = state.params
        if params is None:
            return None
        if params.binding is not None:
            return Found(params.transfer_id, params.binding)
        if not self._concurrent:
            log.warning("request %s has no binding and concurrent mode is off", request.request_id)
            state.no_push = "no binding in the request (concurrent mode off)"
            return None
        got = self._lookups.binding(params.transfer_id)
        if isinstance(got, Exception):
            log.warning("binding %s unavailable (%s); no push", params.transfer_id, got)
            state.no_push = f"binding unavailable: {got}"
            return None
        return Found(params.transfer_id, got)

    def _still_doubting(self, request: Request, state: PrefillRequest, binding: Binding) -> bool:
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

    def _distrust(self, state: PrefillRequest, tid: str, binding: Binding) -> None:
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

    def _refuse(self, state: PrefillRequest, tid: str, binding: Binding) -> bool:
        """Whether P must not take this transfer (checked before the lease, so that a refusal
        leaves the binding unclaimed and D free to drop its blocks at once: the proxy, told by
        P's answer, ends it)."""
        deadline = Destination.of(binding, self._window).deadline
        if deadline and self._wall() >= deadline:
            self.expired += 1
            log.warning("transfer %s: D's load deadline already passed; no push", tid)
            state.no_push = "D's load deadline already passed"
            return True
        refusal = self._pairing(binding)
        if refusal is None:
            return False
        reason, problem = refusal
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

    def _pairing(self, binding: Binding) -> Refusal | None:
        """Why P must not push into ``binding``'s D (``None``: it may). D's registration (the
        registry already vouched for it) gives its revision and KV identity."""
        problem = mismatch(binding.protocol, f"D {binding.decode_instance_id}")
        if problem is not None:
            return Refusal("protocol", problem)
        if binding.block_size != self._block_size:
            return Refusal(
                "layout", f"D block size {binding.block_size} != P block size {self._block_size}"
            )
        try:
            tp.check_pairing(self._tp, binding.tp_size, binding.num_kv_heads, binding.use_mla)
        except LayoutError as exc:
            return Refusal("layout", str(exc))
        d = self._lookups.instance(binding.decode_instance_id)
        if self._spec is None or d is None:
            return None
        found = instances_problem(self._spec, d)
        if found is None:
            return None
        problem = f"D {binding.decode_instance_id} cannot use P's KV: {found.text}"
        return Refusal(found.reason, problem)
