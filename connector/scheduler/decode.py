"""Decode side of the scheduler half: ask for the prompt's KV, publish where it must land.

``matched`` is pure: prompt tokens not in D's prefix cache, loaded asynchronously.
``after_alloc`` hands the binding (D's block ids, cached-token count, KV endpoint) to the
fire-and-forget writer: ``schedule()`` never waits on the network. A binding the metaserver
rejects (4xx) fails the load at once; an unreachable metaserver leaves it to the deadline
(the write may have landed, so P may still be pushing into these blocks).
"""

from __future__ import annotations

import collections
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from connector.metadata import PdgateMetadata, RecvEntry
from connector.stats import StatsCollector
from pdwire.client import BackgroundWriter, MetaserverHTTPError
from pdwire.errors import ParamsError
from pdwire.models import BindingSpec, KVEndpoint
from pdwire.params import parse_decode_leg
from pdwire.version import PROTOCOL_VERSION

if TYPE_CHECKING:
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
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


class DecodeSide:
    def __init__(
        self,
        writer: BackgroundWriter,
        me: Identity,
        load_timeout_s: float = 0.0,
        wall: Callable[[], float] = time.time,
        stats: StatsCollector | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._writer = writer
        self._stats = stats or StatsCollector()
        self._clock = clock
        self._me = me
        self._load_timeout_s = load_timeout_s  # > 0: bindings state D's deadline
        self._wall = wall
        self._claimed: set[str] = set()  # req ids that already asked for their remote prefill
        self._new: list[RecvEntry] = []
        self._rejected: collections.deque[str] = collections.deque()
        self.bindings_sent = 0
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
        return (count, True) if count > 0 else (0, False)

    def after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external: int) -> None:
        if num_external <= 0 or request.request_id in self._claimed:
            return
        params = parse_decode_leg(request.kv_transfer_params)
        if params is None:
            return
        me = self._me
        prompt_len = len(request.prompt_token_ids or ())
        needed = -(-prompt_len // me.block_size)
        block_ids = list(blocks.get_block_ids()[0][:needed])
        spec = BindingSpec(
            request_id=request.request_id,
            decode_instance_id=me.instance_id,
            engine_id=me.engine_id,
            kv_endpoint=me.kv_endpoint,
            tp_size=me.tp_size,
            num_kv_heads=me.num_kv_heads,
            use_mla=me.use_mla,
            block_size=me.block_size,
            block_ids=[block_ids],
            num_cached_tokens=prompt_len - num_external,
            num_prompt_tokens=prompt_len,
            protocol=PROTOCOL_VERSION,
            # the worker starts its kv_load_timeout_s clock when it sees the request, a step
            # later: this is D's deadline or a little before it
            load_deadline=self._wall() + self._load_timeout_s if self._load_timeout_s else None,
        )
        req_id = request.request_id
        stats, clock, sent_at = self._stats, self._clock, self._clock()

        def on_done(_body: bytes | None, error: Exception | None) -> None:
            stats.observe("binding_write_seconds", clock() - sent_at)
            if isinstance(error, MetaserverHTTPError) and 400 <= error.status < 500:
                log.warning("binding %s for %s rejected: %s", params.transfer_id, req_id, error)
                self._rejected.append(req_id)
                stats.add("binding_writes", label="rejected")
            else:
                stats.add("binding_writes", label="error" if error else "ok")

        self._claimed.add(req_id)
        load_from = (prompt_len - num_external) // me.block_size
        self._new.append(RecvEntry(req_id, params.transfer_id, block_ids, load_from))
        self.bindings_sent += 1
        held = len(block_ids) - load_from
        if held > 0:
            self._held[req_id] = held
            self._stats.add("blocks_held", held, label="decode")
        if not self._writer.put_binding(params.transfer_id, spec, on_done=on_done):
            self._rejected.append(req_id)  # queue full: fail fast, nothing was sent
            self._stats.add("binding_writes", label="dropped")

    def fill(self, meta: PdgateMetadata) -> None:
        meta.recvs, self._new = self._new, []
        while self._rejected:
            meta.failed_recvs.append(self._rejected.popleft())

    def loaded(self, req_ids: set[str]) -> None:
        """The workers ended these loads (landed, failed or released): the blocks no longer
        wait for P."""
        for req_id in req_ids:
            held = self._held.pop(req_id, 0)
            if held:
                self._stats.add("blocks_held", -held, label="decode")

    def finished(self, request: Request) -> None:
        # While the request waits for KV, vLLM itself keeps its blocks until the worker
        # reports it in finished_recving (after P's signal or the deadline).
        self._claimed.discard(request.request_id)
