"""The worker half's spans (see ``connector.tracing``): P's push, D's load.

Only transfers whose step metadata carries a sampled ``traceparent`` get a record, and only
in an engine whose tracing is on; the others cost one ``is None`` test per write.

* ``PushTrace`` (P, on the sender thread): per chunk (a ``SendChunk``'s block pairs, the same
  list object for each of its layers) the bytes, layers and write spans; at the transfer's end
  the ``pdgate.connector.push`` span, one ``chunk_pushed`` event per chunk and
  ``done_signal_sent``. A write's *exposed* part is the time after P's forward of the last
  chunk ended (``connector.worker.overlap``): D waits for it; the rest was *hidden* behind
  P's compute.
* ``LoadTrace`` (D): the ``pdgate.connector.kv_load`` span from the worker seeing the load to
  ``finished_recving``, one ``done_signal_received`` event per P rank's signal.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

from connector import wire
from connector.tracing import ConnectorTracer, Event, Value, wall_offset
from connector.worker.transfer import Span, Transfer
from pdwire.trace import TraceParent


@dataclass
class _Chunk:
    pairs: list[tuple[int, int]]  # kept: the chunk is recognised by this list's identity
    index: int
    bytes: int = 0
    layers: set[int] = field(default_factory=set)
    spans: list[Span] = field(default_factory=list)


class PushTrace:
    """One traced transfer on P."""

    __slots__ = ("_chunks", "error", "opened_at", "parent")

    def __init__(self, parent: TraceParent, opened_at: float) -> None:
        self.parent = parent
        self.opened_at = opened_at  # wall clock
        self.error = ""  # what the signal told D (the transfer's error, or the end's failure)
        self._chunks: dict[int, _Chunk] = {}

    def wrote(self, pairs: list[tuple[int, int]], layer: int, nbytes: int, span: Span) -> None:
        """A write carried ``nbytes`` of ``layer`` of the chunk ``pairs`` (sender thread)."""
        chunk = self._chunks.get(id(pairs))
        if chunk is None:
            chunk = self._chunks[id(pairs)] = _Chunk(pairs, len(self._chunks))
        chunk.bytes += nbytes
        chunk.layers.add(layer)
        if not chunk.spans or chunk.spans[-1] is not span:
            chunk.spans.append(span)

    def emit(self, tracer: ConnectorTracer, tr: Transfer, sender: str) -> None:
        """The transfer ended (its signal went out): record its span."""
        offset = wall_offset()
        ov = tr.overlap()
        end = tr.ended_at + offset if tr.ended_at else time.time()
        events: list[Event] = []
        for chunk in self._chunks.values():
            exposed = sum(max(0.0, e - max(s, tr.compute_end)) for s, e in chunk.spans)
            busy = sum(e - s for s, e in chunk.spans)
            last = max(e for _s, e in chunk.spans)
            events.append(
                Event(
                    "chunk_pushed",
                    last + offset,
                    {
                        "pdgate.chunk": chunk.index,
                        "pdgate.blocks": len(chunk.pairs),
                        "pdgate.bytes": chunk.bytes,
                        "pdgate.layers": len(chunk.layers),
                        "pdgate.write_s": busy,
                        "pdgate.exposed_s": exposed if tr.compute_end else 0.0,
                        "pdgate.hidden_s": busy - exposed if tr.compute_end else busy,
                    },
                )
            )
        events.sort(key=lambda ev: ev.at)
        if tr.compute_end:
            events.append(Event("prefill_compute_end", tr.compute_end + offset))
        events.append(Event("done_signal_sent", end, {"pdgate.ok": not self.error}))
        attributes: dict[str, Value] = {
            "pdgate.transfer_id": tr.transfer_id,
            "pdgate.request_id": tr.req_id,
            "pdgate.sender": sender,
            "pdgate.decode_instance": tr.dest.instance_id,
            "pdgate.bytes": tr.bytes,
            "pdgate.chunks": len(self._chunks),
            "pdgate.writes": ov.writes,
            "pdgate.push_s": ov.push_s,
            "pdgate.exposed_s": ov.exposed_s,
            "pdgate.tail_s": ov.tail_s,
            "pdgate.hidden": ov.hidden,
        }
        tracer.emit(
            "pdgate.connector.push",
            self.parent,
            min(self.opened_at, end),
            end,
            attributes,
            events,
            self.error,
        )


@dataclass
class LoadTrace:
    """One traced load on D."""

    parent: TraceParent
    req_id: str
    transfer_id: str
    blocks: int
    start: float  # wall clock
    events: list[Event] = field(default_factory=list)


class LoadTraces:
    """D's traced loads in flight: opened by the forward thread, signalled from the side
    channel's thread, ended by ``transfer_results``."""

    def __init__(self, tracer: ConnectorTracer) -> None:
        self._tracer = tracer
        self._lock = threading.Lock()
        self._by_tid: dict[str, LoadTrace] = {}

    def open(self, parent: TraceParent, req_id: str, transfer_id: str, blocks: int) -> None:
        with self._lock:
            self._by_tid.setdefault(
                transfer_id, LoadTrace(parent, req_id, transfer_id, blocks, time.time())
            )

    def signal(self, sig: wire.Signal) -> None:
        with self._lock:
            load = self._by_tid.get(sig.transfer_id)
            if load is not None:
                attributes: dict[str, Value] = {"pdgate.sender": sig.sender, "pdgate.ok": sig.ok}
                load.events.append(Event("done_signal_received", time.time(), attributes))

    def ended(self, finished: set[str], failed: set[str]) -> None:
        """Record the loads in ``finished`` (vLLM's ``finished_recving``; ``failed`` too)."""
        if not finished:
            return
        with self._lock:
            done = [t for t in self._by_tid.values() if t.req_id in finished]
            for t in done:
                del self._by_tid[t.transfer_id]
        now = time.time()
        for t in done:
            bad = t.req_id in failed
            t.events.append(Event("load_failed" if bad else "load_finished", now))
            attributes: dict[str, Value] = {
                "pdgate.transfer_id": t.transfer_id,
                "pdgate.request_id": t.req_id,
                "pdgate.blocks": t.blocks,
                "pdgate.signals": sum(1 for e in t.events if e.name == "done_signal_received"),
            }
            error = "KV load failed (vLLM recomputes or fails the request)" if bad else ""
            self._tracer.emit(
                "pdgate.connector.kv_load", t.parent, t.start, now, attributes, t.events, error
            )
