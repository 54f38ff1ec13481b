"""D's load path on a worker rank: the loads each step expects, and how they ended.

``LoadSide`` tells the receive tracker (receiver.py) which requests will load (``RecvEntry``),
which failed at once (their binding rejected) and which were released (P never took their
binding); each ``results`` polls it and keeps, per load that ended, the blocks it was to fill
(vLLM before 0.32 learns of failed loads by block), counting blocks pushed or recomputed per
P instance. With ``verify_kv`` (or digests P sends as proof of arrival) the tracker checks the
landed KV against P's digests over this rank's memory (``check_landed``).

Runs on vLLM's forward thread (the worker half's hooks), but for ``on_signal``: the side-channel
thread's, as D's ``SideChannelServer`` hands it each done signal (traced loads get an event).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import NamedTuple

from connector import wire
from connector.compat import features
from connector.config import ConnectorSettings
from connector.metadata import PdgateMetadata
from connector.stats import StatsCollector
from connector.tracing import ConnectorTracer, sampled
from connector.worker import digest
from connector.worker.memory import KVMemory
from connector.worker.receiver import RecvTracker
from connector.worker.traces import LoadTraces


class Ended(NamedTuple):
    """The loads a poll ended: the failed ones are in ``finished`` too, as vLLM expects."""

    finished: set[str]
    failed: set[str]


class LoadSide:
    def __init__(
        self,
        settings: ConnectorSettings,
        stats: StatsCollector,
        tracer: ConnectorTracer | None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._stats = stats
        self.tracker = RecvTracker(
            settings.kv_load_timeout_s,
            clock,
            landing_wait_s=settings.landing_wait_s,
            # the scheduler quarantines what a silent P may still write only where vLLM hands
            # the connector its KV cache manager
            silence_s=settings.silence_s if features().bind_manager else 0.0,
            stats=stats,
        )
        self.tracker.on_landed = self._count_landed
        self._traces = LoadTraces(tracer) if tracer is not None else None
        self._memory: KVMemory | None = None
        self._blocks: dict[str, list[int]] = {}  # the blocks each expected load fills
        self._ended: dict[str, list[int]] = {}  # ... of the loads the last poll ended

    def attach(self, memory: KVMemory) -> None:
        """This rank's KV memory, registered: the loads' bytes are counted in its blocks."""
        self._memory = memory

    def check_landed(self, checksums: digest.Checksums, require: bool) -> None:
        """Check whatever digests P ranks send against what landed in this rank's memory;
        ``require``: every load must come with digests (D's ``verify_kv``)."""
        memory = self._memory
        assert memory is not None
        self.tracker.verify = lambda sig: digest.check(memory, sig.digests, checksums)
        self.tracker.require_digests = require

    @property
    def on_signal(self) -> Callable[[wire.Signal], None]:
        """What D's side-channel server calls with each done signal."""
        return self.tracker.on_signal if self._traces is None else self._on_signal

    def _on_signal(self, sig: wire.Signal) -> None:
        self.tracker.on_signal(sig)
        assert self._traces is not None
        self._traces.signal(sig)

    def absorb(self, meta: PdgateMetadata) -> None:
        """The step's loads: expected, failed at once, released."""
        for recv in meta.recvs:
            self.tracker.expect(recv.req_id, recv.transfer_id)
            self._blocks[recv.req_id] = recv.block_ids[recv.load_from :]
            if self._traces is not None and (parent := sampled(recv.traceparent)) is not None:
                blocks = len(recv.block_ids) - recv.load_from
                self._traces.open(parent, recv.req_id, recv.transfer_id, blocks)
        for req_id in meta.failed_recvs:
            self.tracker.fail(req_id)
        if meta.released_recvs:
            self.tracker.release(meta.released_recvs)

    def aborted(self, req_ids: set[str]) -> None:
        self.tracker.aborted(req_ids)

    def results(self, recompute: bool) -> Ended:
        """The loads that ended since the last call; ``recompute``: vLLM recomputes a failed
        load (else fails its request)."""
        recving, failed = self.tracker.poll()
        if self._traces is not None:
            self._traces.ended(recving, failed)
        if failed and recompute:
            self._stats.add("recomputes", len(failed))
        self._ended = {r: self._blocks.pop(r, []) for r in recving}
        for req_id, source in self.tracker.take_sources().items():
            blocks = len(self._ended.get(req_id, ()))
            if source.intact:
                self._stats.add("blocks_pushed", blocks, label=source.prefill)
            elif recompute:
                self._stats.add("blocks_recomputed", blocks, label=source.prefill)
        return Ended(recving, failed)

    def blocks_of(self, req_ids: set[str]) -> set[int]:
        """The blocks the loads of ``req_ids`` were to fill, for loads the last ``results``
        ended."""
        return {b for r in req_ids for b in self._ended.get(r, ())}

    def _count_landed(self, req_id: str) -> None:
        """A load ended intact: its blocks hold P's KV now."""
        blocks = len(self._blocks.get(req_id, ()))
        if blocks and self._memory is not None:
            self._stats.add("recv_blocks", blocks)
            self._stats.add("recv_bytes", blocks * self._memory.bytes_per_block)
