"""What P's sender keeps per transfer, and the tasks the forward thread queues for it.

``push_layer`` queues a ``LayerTask`` (one layer of one chunk, behind the event that marks its KV
written), ``end`` an ``EndTask`` (signal D: done, or failed). The ``Transfer`` collects what the
sender thread learns on the way: bytes, write spans, digests, the error that ends it.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, NamedTuple, Protocol

from connector import tp
from connector.device import Event
from connector.layout import Piece
from connector.metadata import Destination
from connector.worker import digest
from connector.worker.overlap import overlap
from pdwire.push_summary import PushOverlap

if TYPE_CHECKING:
    from connector.tracing import ConnectorTracer

LayoutKey = tuple[int, int]  # (P layout index, D layout index)


class Span(NamedTuple):
    """One write on the ``perf_counter`` clock."""

    start: float
    end: float


class TransferTrace(Protocol):
    """A traced transfer's record (``connector.worker.traces.PushTrace``): told each write
    (sender thread), its error, and emitted when the transfer ends."""

    error: str

    def wrote(self, pairs: list[tuple[int, int]], layer: int, nbytes: int, span: Span) -> None: ...

    def emit(self, tracer: ConnectorTracer, tr: Transfer, sender: str) -> None: ...


@dataclass
class ChunkPieces:
    """The pieces of the chunk being pushed, per layout pair (layers sharing a layout pair share
    the pieces); ``pairs`` is the chunk's own list, recognised by identity."""

    pairs: list[tuple[int, int]]
    by_layout: dict[LayoutKey, list[Piece]] = field(default_factory=dict)


@dataclass(eq=False)  # one transfer is one object: compared and hashed by identity
class Transfer:
    """One leg of a request's push: this P rank's writes into one D rank (``route``)."""

    req_id: str
    transfer_id: str
    dest: Destination
    route: tp.Route
    # every leg of the request, this one included (one list, shared by the legs)
    legs: list[Transfer] = field(repr=False)
    queued: int = 0  # tasks not processed yet
    writing: int = 0  # its layer tasks in writes a lane has not reported (sender thread only)
    ended: bool = False  # signal sent (done or failed), or nothing to signal
    announced: bool = False  # the first write landed (a "pushing" event went out)
    error: str = ""
    bytes: int = 0
    cached: ChunkPieces | None = None
    written: list[digest.Written] = field(default_factory=list)  # with ``verify``
    # push-overlap bookkeeping (perf_counter): each write's span, P's compute end, signal sent
    write_spans: list[Span] = field(default_factory=list)
    compute_end: float = 0.0
    ended_at: float = 0.0
    settle_s: float = 0.0  # a write failed: its pieces may land this long after (see Signal)
    trace: TransferTrace | None = None  # tracing on and the proxy's context sampled

    @property
    def d_port(self) -> int:
        return self.dest.port + self.route.d_rank

    @property
    def first_leg(self) -> bool:
        return self.legs[0] is self

    def all_ended(self) -> bool:
        """Every leg of the request has sent its signal."""
        return all(leg.ended for leg in self.legs)

    def overlap(self) -> PushOverlap:
        offset = time.time() - time.perf_counter()
        return overlap(self.write_spans, self.compute_end, self.ended_at, offset)


def overlap_of(legs: list[Transfer]) -> PushOverlap:
    """The push overlap of a request over all its legs (their writes together; it ended with
    the last leg's signal)."""
    spans = sorted({id(s): s for leg in legs for s in leg.write_spans}.values())
    compute_end = max(leg.compute_end for leg in legs)
    ended_at = max(leg.ended_at for leg in legs)
    offset = time.time() - time.perf_counter()
    return overlap(spans, compute_end, ended_at, offset)


@dataclass(frozen=True, slots=True)
class LayerTask:
    """Write ``layer`` of the chunk ``pairs`` once ``event`` says its KV is written."""

    transfer: Transfer
    pairs: list[tuple[int, int]]
    layer: int
    event: Event


@dataclass(frozen=True, slots=True)
class EndTask:
    """No more layers: signal D (done, or failed with ``fail``)."""

    transfer: Transfer
    fail: str


Task = LayerTask | EndTask
Outcome = Callable[[Transfer], None]
