"""The sender's transfers by request id, shared by the forward thread and the sender thread.

A request's push is one ``Transfer`` per D rank this P rank writes into (its *legs*, see
tp.py): one when P tp >= D tp, several when D tp > P tp, none for a replica that writes
nothing. The forward thread opens them, counts the tasks it queues and asks whether a request's
blocks may be freed; the sender thread counts tasks done and marks transfers ended. One lock
guards the counters; waiters on a request's queue draining are woken as tasks finish.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from connector import tp
from connector.metadata import SendChunk
from connector.worker.transfer import Task, Transfer

Router = Callable[[SendChunk], list[tp.Route]]


class Ledger:
    def __init__(self, route: Router) -> None:
        self._route = route
        self._lock = threading.Lock()
        self._cv = threading.Condition(self._lock)
        self.transfers: dict[str, list[Transfer]] = {}  # per request: its legs
        # called (outside the lock) when a transfer this rank writes is opened: the
        # keep-alives tell D at once, not up to ``keepalive_s`` later
        self.on_open: Callable[[], None] | None = None

    # ---- forward thread -------------------------------------------------------------------
    def open(self, chunk: SendChunk) -> list[Transfer]:
        """The request's legs, opened at its first chunk (empty: this rank writes nothing)."""
        with self._lock:
            legs = self.transfers.get(chunk.req_id)
            if legs is not None:
                return legs
            legs = []
            for route in self._route(chunk):
                legs.append(Transfer(chunk.req_id, chunk.transfer_id, chunk.dest, route, legs))
            self.transfers[chunk.req_id] = legs
            if not legs:
                return legs
        if self.on_open is not None:
            self.on_open()
        return legs

    def get(self, req_id: str) -> list[Transfer]:
        with self._lock:
            return self.transfers.get(req_id, [])

    def queued(self, task: Task) -> None:
        with self._lock:
            task.transfer.queued += 1

    def settled(self, req_id: str) -> bool:
        """Whether P's blocks of ``req_id`` may be released: every push from them has ended,
        and, when a retry succeeded after a failed write, that abandoned write can no longer
        read them (``settle_s`` after the end): D decodes from the blocks it writes. A failed
        transfer's blocks are released at its end: D never reads its destination blocks
        and keeps them out of use while a late piece may still land, whatever the bytes."""
        with self._lock:
            return all(self._settled(tr) for tr in self.transfers.get(req_id, ()))

    @staticmethod
    def _settled(tr: Transfer) -> bool:
        if tr.queued or not tr.ended:
            return False
        if tr.error or not tr.settle_s:
            return True
        return time.perf_counter() >= tr.ended_at + tr.settle_s

    def quiet(self, req_id: str) -> bool:
        with self._lock:
            return self._quiet_locked(req_id)

    def wait_quiet(self, req_id: str, timeout_s: float) -> bool:
        with self._cv:
            return self._cv.wait_for(lambda: self._quiet_locked(req_id), timeout_s)

    def _quiet_locked(self, req_id: str) -> bool:
        return all(tr.queued == 0 for tr in self.transfers.get(req_id, ()))

    def open_transfers(self) -> list[Transfer]:
        """Transfers this rank writes and has not ended (for the keep-alives)."""
        with self._lock:
            return [t for legs in self.transfers.values() for t in legs if not t.ended]

    def forget(self, req_id: str) -> None:
        with self._lock:
            self.transfers.pop(req_id, None)

    # ---- sender thread --------------------------------------------------------------------
    def done(self, task: Task) -> None:
        with self._cv:
            task.transfer.queued -= 1
            self._cv.notify_all()

    def ended(self, tr: Transfer) -> None:
        with self._lock:
            tr.ended = True
