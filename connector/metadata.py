"""What the scheduler half tells the worker half each step (pickled with ``SchedulerOutput``)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorMetadata,
    KVConnectorWorkerMetadata,
)

from pdwire.models import Binding


def skew_margin(window_s: float) -> float:
    """How long before D's deadline P stops writing: clock skew and writes still in flight."""
    return min(5.0, 0.1 * window_s)


@dataclass(frozen=True, slots=True)
class Destination:
    """A verified decode instance (from its binding), as the P workers need it."""

    instance_id: str
    engine_id: str
    host: str
    port: int  # side-channel base port; D rank r listens on port + r
    tp_size: int
    num_kv_heads: int | None
    use_mla: bool
    block_size: int
    deadline: float = 0.0  # wall clock (epoch s) after which D has given up: never write then

    @classmethod
    def of(cls, b: Binding, window_s: float = 0.0) -> Destination:
        """``deadline``: D's ``load_deadline`` less a margin for clock skew and writes in flight
        (5 s, or 10 % of D's window); without one, ``created_at + window_s``."""
        if b.load_deadline is not None:
            deadline = b.load_deadline - skew_margin(max(0.0, b.load_deadline - b.created_at))
        else:
            deadline = b.created_at + window_s if window_s > 0 else 0.0
        return cls(
            b.decode_instance_id,
            b.engine_id,
            b.kv_endpoint.host,
            b.kv_endpoint.port + b.tp_rank_offset,
            b.tp_size,
            b.num_kv_heads,
            b.use_mla,
            b.block_size,
            deadline,
        )


@dataclass(frozen=True, slots=True)
class SendChunk:
    """Blocks of one request that became complete in this step: push them layer by layer."""

    req_id: str
    transfer_id: str
    dest: Destination
    pairs: list[tuple[int, int]]  # (P block id, D block id)
    last: bool  # the request's prefill ends in this step: signal D after the last layer
    fail: str = ""  # with ``last``: signal D that this transfer failed (e.g. P preempted)
    traceparent: str = ""  # the proxy's prefill-leg span (tracing on; connector/tracing.py)


# what D is told of an ``Abandoned`` lease
ABANDONED = "P's request ended before it pushed anything (aborted or failed)"


@dataclass(frozen=True, slots=True)
class Abandoned:
    """A lease P took for a request vLLM already dropped before any of its blocks went to the
    workers: signal D a failed end (nothing was written) and forget it (connector/scheduler/
    leases.py)."""

    transfer_id: str
    dest: Destination
    traceparent: str = ""


@dataclass(frozen=True, slots=True)
class RecvEntry:
    req_id: str
    transfer_id: str
    block_ids: list[int]
    load_from: int = 0  # the first block the load fills (those before: D's own prefix hit)
    traceparent: str = ""  # the proxy's decode-leg span (tracing on; connector/tracing.py)


@dataclass
class PdgateMetadata(KVConnectorMetadata):
    sends: list[SendChunk] = field(default_factory=list)
    recvs: list[RecvEntry] = field(default_factory=list)
    failed_recvs: list[str] = field(default_factory=list)  # req ids whose binding was rejected
    # aborted req ids whose binding ended before P took it: no push can come, free at once
    released_recvs: list[str] = field(default_factory=list)
    abandoned: list[Abandoned] = field(default_factory=list)  # leases to close (P)


@dataclass(frozen=True)
class PdgateWorkerMetadata(KVConnectorWorkerMetadata):
    """What the workers tell the scheduler half each step (vLLM aggregates the ranks')."""

    # req ids whose load failed because P went silent: P may be frozen and write later, so the
    # scheduler keeps their blocks out of use until the load's deadline
    silent: frozenset[str] = frozenset()
    # req id -> wall-clock time its load's KV was all there on this rank; the load is ready
    # once every rank has it, so ranks combine by the latest
    ready: Mapping[str, float] = field(default_factory=dict)

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        assert isinstance(other, PdgateWorkerMetadata)
        ready = dict(self.ready)
        for req_id, at in other.ready.items():
            ready[req_id] = max(at, ready.get(req_id, at))
        return PdgateWorkerMetadata(self.silent | other.silent, ready)
