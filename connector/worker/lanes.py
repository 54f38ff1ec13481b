"""Write lanes: one writer thread per D session, so a D that stalls holds only its own writes.

A transport write to a D that is frozen (stopped, swapping, its NIC wedged) waits for the
transport's deadline, Mooncake's ``MC_TRANSFER_TIMEOUT`` (10 s by default), once per retry.
Issued from the sender thread, it held every other D's push behind it: a proxy that gave up on
the frozen D and retried the request on another D found the same P unable to push there until
the frozen write ended. Each lane writes its session's batches in the order they came (a
transfer's layers keep their order) and hands each outcome back to the sender thread as a
``Written``; recording, signals and the ledger stay on that thread.

Before a write a lane drops the parts of transfers that cannot use it: one whose earlier write
failed in this lane (its transfer fails anyway: each further write to a stalled D would wait
for the deadline again), or one whose D load deadline has passed while the write was queued.
A lane with nothing to do for ``idle_s`` ends; the next write to its session starts another.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from connector.errors import TransferError
from connector.worker.batch import Part, Write
from connector.worker.transfer import Span, Transfer
from connector.worker.writer import RetryingWriter

log = logging.getLogger("pdgate.connector.sender")

IDLE_S = 60.0


@dataclass(frozen=True, slots=True)
class Written:
    """A write's outcome (``error`` None: it landed in ``span``), for the sender thread."""

    write: Write
    span: Span
    error: TransferError | None
    dropped: bool = False  # not written: its transfers had failed, or D's deadline passed


class Lanes:
    def __init__(
        self,
        writer: RetryingWriter,
        done: Callable[[Written], None],
        wall_clock: Callable[[], float],
        idle_s: float = IDLE_S,
    ) -> None:
        """``done`` runs on the lane's thread and must only hand the outcome over."""
        self._writer = writer
        self._done = done
        self._wall = wall_clock
        self._idle_s = idle_s
        self._lock = threading.Lock()
        self._lanes: dict[str, _Lane] = {}
        self._stopping = False

    def submit(self, w: Write) -> None:
        with self._lock:
            if self._stopping:
                raise RuntimeError("write lanes are stopped")
            lane = self._lanes.get(w.session)
            if lane is None:
                lane = self._lanes[w.session] = _Lane(self, w.session)
                lane.thread.start()
            lane.inbox.put(w)

    def busy(self) -> int:
        """Lanes running (one per D session written to in the last ``idle_s``)."""
        with self._lock:
            return len(self._lanes)

    def stop(self, timeout_s: float) -> None:
        """Let the lanes finish what they hold, then end them (each waits up to
        ``timeout_s``: a write to a stalled D may still be waiting for its deadline)."""
        with self._lock:
            self._stopping = True
            lanes = list(self._lanes.values())
        for lane in lanes:
            lane.inbox.put(None)
        for lane in lanes:
            lane.thread.join(timeout_s)

    def _next(self, lane: _Lane) -> Write | None:
        """The lane's next write; None once it is told to stop, or has been idle and is
        retired (under the lock, so a write submitted meanwhile starts a new lane)."""
        while True:
            try:
                return lane.inbox.get(timeout=self._idle_s)
            except queue.Empty:
                with self._lock:
                    if lane.inbox.empty():
                        del self._lanes[lane.session]
                        return None

    def _run(self, lane: _Lane) -> None:
        failed: set[Transfer] = set()  # transfers whose write failed in this lane
        while (w := self._next(lane)) is not None:
            keep, dropped, why = self._sort(w, failed)
            now = time.perf_counter()
            if dropped:
                self._done(Written(_write_of(w.session, dropped), Span(now, now), why, True))
            if not keep:
                continue
            w = _write_of(w.session, keep) if dropped else w
            try:
                self._writer.write(w)
            except TransferError as exc:
                failed.update(p.task.transfer for p in w.parts)
                self._done(Written(w, Span(now, time.perf_counter()), exc))
            except Exception as exc:  # a transport bug must still end the transfers
                log.exception("write to %s failed", w.session)
                failed.update(p.task.transfer for p in w.parts)
                self._done(Written(w, Span(now, time.perf_counter()), TransferError(repr(exc))))
            else:
                self._done(Written(w, Span(now, time.perf_counter()), None))
            failed = {tr for tr in failed if not tr.ended}  # forget the finished ones

    def _sort(
        self, w: Write, failed: set[Transfer]
    ) -> tuple[list[Part], list[Part], TransferError | None]:
        keep: list[Part] = []
        dropped: list[Part] = []
        why = ""
        now = self._wall()
        for part in w.parts:
            tr = part.task.transfer
            if tr in failed:
                dropped.append(part)
                why = why or "an earlier write of this transfer failed"
            elif tr.dest.deadline and now >= tr.dest.deadline:
                dropped.append(part)
                why = why or "push deadline passed while the write waited: D has given up"
            else:
                keep.append(part)
        return keep, dropped, TransferError(why) if dropped else None


class _Lane:
    def __init__(self, lanes: Lanes, session: str) -> None:
        self.session = session
        self.inbox: queue.SimpleQueue[Write | None] = queue.SimpleQueue()
        self.thread = threading.Thread(
            target=lanes._run, args=(self,), name=f"pdgate-lane-{session}", daemon=True
        )


def _write_of(session: str, parts: list[Part]) -> Write:
    w = Write(session)
    for part in parts:
        w.add(part)
    return w
