"""Decode side of the scheduler half: ask for the prompt's KV, publish where it must land.

``matched`` is pure: prompt tokens not in D's prefix cache, loaded asynchronously.
``after_alloc`` hands the binding (D's block ids, cached-token count, KV endpoint) to the
fire-and-forget writer: ``schedule()`` never waits on the network. A binding the metaserver
rejects (4xx) fails the load at once; an unreachable metaserver leaves it to the deadline
(the write may have landed, so P may still be pushing into these blocks).

The binding is the lease. When a request still waiting for its KV is aborted, D ends its binding
(``aborted``, from the writer's thread). If P never took it (no ``prefill_started`` in its
history: P's own compare-and-set from ``bound`` lost or never ran) no push can start any more,
and the worker is told to release the blocks at once; otherwise they stay held until P's done
signal or the deadline, as P may be writing into them.
"""

from __future__ import annotations

import collections
import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from vllm.v1.request import RequestStatus

from connector.metadata import PdgateMetadata, RecvEntry
from connector.stats import StatsCollector
from connector.tracing import ConnectorTracer, Event, Value
from pdwire.client import (
    BackgroundWriter,
    BindingWrite,
    ConflictError,
    MetaserverHTTPError,
    NotFoundError,
)
from pdwire.errors import ParamsError
from pdwire.models import Binding, BindingSpec, BindingState, EventDetail, KVEndpoint
from pdwire.params import RecvParams, parse_decode_leg
from pdwire.trace import TraceParent
from pdwire.version import PROTOCOL_VERSION

if TYPE_CHECKING:
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks, KVCacheManager
    from vllm.v1.core.kv_cache_utils import KVCacheBlock
    from vllm.v1.request import Request

log = logging.getLogger("pdgate.connector.decode")


@dataclass(frozen=True, slots=True)
class Identity:
    instance_id: str
    engine_id: str
    kv_endpoint: KVEndpoint
    tp_size: int
    num_kv_heads: int | None
    use_mla: bool
    block_size: int


@dataclass(frozen=True, slots=True)
class _Load:
    """A request waiting for P's push."""

    transfer_id: str
    blocks: list[int]  # the blocks P writes (after D's own prefix hit)
    # monotonic: D's load deadline (P starts no write after it) plus the late-landing hold
    expires: float


@dataclass(frozen=True, slots=True)
class _Draft:
    """What the scheduler thread keeps of a binding; the writer's thread builds the body."""

    me: Identity
    request_id: str
    block_ids: list[int]
    num_cached_tokens: int
    num_prompt_tokens: int
    load_deadline: float | None

    def spec(self) -> BindingSpec:
        me = self.me
        # built without re-validating what this process computed (the metaserver validates
        # the body at its edge): pydantic's checks of every block id cost tens of µs
        return BindingSpec.model_construct(
            request_id=self.request_id,
            decode_instance_id=me.instance_id,
            engine_id=me.engine_id,
            kv_endpoint=me.kv_endpoint,
            tp_size=me.tp_size,
            num_kv_heads=me.num_kv_heads,
            use_mla=me.use_mla,
            block_size=me.block_size,
            block_ids=[self.block_ids],
            num_cached_tokens=self.num_cached_tokens,
            num_prompt_tokens=self.num_prompt_tokens,
            protocol=PROTOCOL_VERSION,
            load_deadline=self.load_deadline,
        )


@dataclass(frozen=True, slots=True)
class _Quarantine:
    expires: float
    blocks: list[KVCacheBlock]


class DecodeSide:
    def __init__(
        self,
        writer: BackgroundWriter,
        me: Identity,
        load_timeout_s: float = 0.0,
        wall: Callable[[], float] = time.time,
        tracer: ConnectorTracer | None = None,
        stats: StatsCollector | None = None,
        clock: Callable[[], float] = time.monotonic,
        late_landing_s: float = 0.0,
    ) -> None:
        self._writer = writer
        # a write P had in flight when it froze may still land this long after D's deadline
        # (its transport's write and lane deadlines): quarantined blocks are held that long too
        self.late_landing_s = late_landing_s
        self._tracer = tracer  # tracing on in this engine
        self._stats = stats or StatsCollector()
        self._clock = clock
        self._me = me
        self._load_timeout_s = load_timeout_s  # > 0: bindings state D's deadline
        self._wall = wall
        self._claimed: set[str] = set()  # req ids that already asked for their remote prefill
        self._new: list[RecvEntry] = []
        self._outbox: list[BindingWrite] = []  # this step's bindings, submitted in ``fill``
        self._outbox_reqs: list[str] = []  # their request ids
        # matched() parsed these (req id -> params); after_alloc takes them
        self._asked: dict[str, RecvParams] = {}
        self._rejected: collections.deque[str] = collections.deque()
        self._loading: dict[str, _Load] = {}  # by req id, until its KV is in
        self._manager: KVCacheManager | None = None
        self._quarantined: list[_Quarantine] = []
        self._released: collections.deque[str] = collections.deque()  # abort won: free now
        self.bindings_sent = 0
        self.released = 0  # aborted loads freed at once (P never took the binding)
        self.held = 0  # aborted loads P had taken: held until its signal or the deadline
        self.quarantined_blocks = 0  # blocks a silent P may still write, kept out of use now

    def bind(self, manager: KVCacheManager) -> None:
        self._manager = manager
        self._held: dict[str, int] = {}  # req id -> blocks waiting for P's KV

    def matched(self, request: Request, num_computed_tokens: int) -> tuple[int, bool]:
        try:
            params = parse_decode_leg(request.kv_transfer_params)
        except ParamsError as exc:
            log.warning("request %s: %s; computing locally", request.request_id, exc)
            return 0, False
        if params is None or request.request_id in self._claimed:
            return 0, False
        count = len(request.prompt_token_ids or ()) - num_computed_tokens
        if count <= 0:
            return 0, False
        self._asked[request.request_id] = params
        return count, True

    def after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external: int) -> None:
        req_id = request.request_id
        if num_external <= 0 or req_id in self._claimed:
            return
        params = self._asked.pop(req_id, None) or parse_decode_leg(request.kv_transfer_params)
        if params is None:
            return
        me = self._me
        prompt_len = len(request.prompt_token_ids or ())
        needed = -(-prompt_len // me.block_size)
        block_ids = list(blocks.get_block_ids()[0][:needed])
        draft = _Draft(
            me,
            req_id,
            block_ids,
            prompt_len - num_external,
            prompt_len,
            # the worker starts its kv_load_timeout_s clock when it sees the request, a step
            # later: this is D's deadline or a little before it
            self._wall() + self._load_timeout_s if self._load_timeout_s else None,
        )
        trace = params.trace if self._tracer is not None else None
        traced_at = self._wall() if trace is not None and trace.sampled else None
        stats, clock, sent_at = self._stats, self._clock, self._clock()

        def on_done(_body: bytes | None, error: Exception | None) -> None:
            stats.observe("binding_write_seconds", clock() - sent_at)
            if isinstance(error, MetaserverHTTPError) and 400 <= error.status < 500:
                log.warning("binding %s for %s rejected: %s", params.transfer_id, req_id, error)
                self._rejected.append(req_id)
                stats.add("binding_writes", label="rejected")
            else:
                stats.add("binding_writes", label="error" if error else "ok")
            if trace is not None and traced_at is not None:
                self._bound(trace, draft, params.transfer_id, traced_at, error)

        self._claimed.add(req_id)
        load_from = (prompt_len - num_external) // me.block_size
        expires = self._clock() + self._load_timeout_s + self.late_landing_s
        self._loading[req_id] = _Load(params.transfer_id, block_ids[load_from:], expires)
        tp = trace.header() if trace is not None else ""
        self._new.append(RecvEntry(req_id, params.transfer_id, block_ids, load_from, tp))
        self.bindings_sent += 1
        held = len(block_ids) - load_from
        if held > 0:
            self._held[req_id] = held
            self._stats.add("blocks_held", held, label="decode")
        self._outbox.append(BindingWrite(params.transfer_id, draft.spec, on_done))
        self._outbox_reqs.append(req_id)

    def _bound(
        self,
        trace: TraceParent,
        draft: _Draft,
        transfer_id: str,
        start: float,
        error: Exception | None,
    ) -> None:
        """The ``pdgate.connector.bind`` span: blocks allocated → the metaserver answered
        (on the background writer's thread)."""
        assert self._tracer is not None
        end = self._wall()
        attributes: dict[str, Value] = {
            "pdgate.transfer_id": transfer_id,
            "pdgate.request_id": draft.request_id,
            "pdgate.instance": draft.me.instance_id,
            "pdgate.blocks": len(draft.block_ids),
            "pdgate.cached_tokens": draft.num_cached_tokens,
            "pdgate.prompt_tokens": draft.num_prompt_tokens,
        }
        events = [Event("binding_written" if error is None else "binding_failed", end)]
        why = "" if error is None else f"binding write failed: {error}"
        self._tracer.emit("pdgate.connector.bind", trace, start, end, attributes, events, why)

    def fill(self, meta: PdgateMetadata) -> None:
        # the step's bindings go to the writer together, at the end of ``schedule()``: waking
        # a writer thread per request in the middle of it handed the GIL to the thread's
        # HTTP work while the scheduler still had requests to admit. Their bodies are built
        # and serialised on the writer's threads.
        if self._outbox:
            outbox, reqs, self._outbox, self._outbox_reqs = self._outbox, self._outbox_reqs, [], []
            queued = self._writer.put_bindings(outbox)
            for req_id in reqs[queued:]:  # queue full: fail fast, nothing sent
                meta.failed_recvs.append(req_id)
                self._stats.add("binding_writes", label="dropped")
        meta.recvs, self._new = self._new, []
        while self._rejected:
            meta.failed_recvs.append(self._rejected.popleft())
        while self._released:
            meta.released_recvs.append(self._released.popleft())
        self._end_quarantines()

    def loaded(self, req_ids: Iterable[str]) -> None:
        """The workers ended these loads (``finished_recving``: landed, failed or released):
        nothing to end any more, and the blocks no longer wait for P."""
        for req_id in req_ids:
            self._loading.pop(req_id, None)
            held = self._held.pop(req_id, 0)
            if held:
                self._stats.add("blocks_held", -held, label="decode")

    def quarantine(self, req_ids: Iterable[str]) -> None:
        """Loads failed because P went silent: P may only be frozen and write into these blocks
        when it wakes (it starts no write past D's deadline, but one it had in flight can
        finish later), so hold one more reference on each until the deadline plus the
        late-landing hold: vLLM frees or recomputes the request into other blocks meanwhile."""
        if self._manager is None:
            return
        pool = self._manager.block_pool
        for req_id in req_ids:
            load = self._loading.get(req_id)
            if load is None or not load.blocks:
                continue
            blocks = [pool.blocks[b] for b in load.blocks]
            pool.touch(blocks)
            self.quarantined_blocks += len(blocks)
            self._quarantined.append(_Quarantine(load.expires, blocks))
            log.info(
                "transfer %s (%s): %d blocks kept out of use for %.0fs (P may still write them)",
                load.transfer_id,
                req_id,
                len(blocks),
                max(0.0, load.expires - self._clock()),
            )

    def _end_quarantines(self) -> None:
        if not self._quarantined:
            return
        now = self._clock()
        assert self._manager is not None
        ended = [q for q in self._quarantined if q.expires <= now]
        if ended:
            self._quarantined = [q for q in self._quarantined if q.expires > now]
        for q in ended:
            self._manager.block_pool.free_blocks(q.blocks)
            self.quarantined_blocks -= len(q.blocks)

    def finished(self, request: Request) -> None:
        # While the request waits for KV, vLLM itself keeps its blocks until the worker
        # reports it in finished_recving (after P's signal, the deadline, or a won abort).
        req_id = request.request_id
        self._claimed.discard(req_id)
        self._asked.pop(req_id, None)
        load = self._loading.pop(req_id, None)
        if load is None or request.status != RequestStatus.FINISHED_ABORTED:
            return
        tid = load.transfer_id

        def on_done(body: bytes | None, error: Exception | None) -> None:
            self._after_abort(req_id, tid, body, error)

        detail = EventDetail(message="D's request was aborted while it waited for the KV")
        self._writer.post_event(
            tid,
            BindingState.ABORTED,
            self._me.instance_id,
            detail,
            on_done=on_done,
            quiet_conflict=True,  # P often ended it first (its failure)
        )

    def _after_abort(
        self, req_id: str, tid: str, body: bytes | None, error: Exception | None
    ) -> None:
        """On the writer's thread: release the blocks when P cannot have taken the binding."""
        binding: Binding | None = None
        if body is not None:
            binding = Binding.model_validate_json(body)
        elif isinstance(error, ConflictError):  # already ended (by P, an admin, D's deadline)
            try:
                binding = self._writer.client.find_binding(tid)
            except Exception as exc:
                log.info("transfer %s: reading the ended binding failed: %s", tid, exc)
                return
        elif not isinstance(error, NotFoundError):
            return  # unreachable metaserver: P may hold the lease; the deadline decides
        if binding is not None and binding.claimed:
            self.held += 1
            log.debug("transfer %s (%s): P took it; blocks held until P's signal", tid, req_id)
            return
        self.released += 1
        log.debug("transfer %s (%s): aborted before P took it; blocks freed", tid, req_id)
        self._released.append(req_id)
