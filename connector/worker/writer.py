"""The sender's transport write: one batch, retried on failure with the same bytes.

A failed attempt may still land later (``Transport.late_landing_s``), so its transfers tell D
to hold their blocks that long before decoding from them or freeing them (``settle_s``).
No retry goes to a D that is gone (``gone`` names why: its side channel refuses
connections); a write to it can only wait for its deadline again, holding its lane (lanes.py).

``IN_FLIGHT`` names the write being issued, for transport wrappers that act on what a write
carries (which transfer and layer each piece belongs to) rather than on bare addresses; the
test-only ``test_corrupt_push`` wrapper (tamper.py) is one.
"""

from __future__ import annotations

import contextvars
import logging
import threading
import time
from collections.abc import Callable

from connector.errors import TransferError
from connector.stats import StatsCollector
from connector.transport import Transport
from connector.worker.batch import Write

log = logging.getLogger("pdgate.connector.sender")

IN_FLIGHT: contextvars.ContextVar[Write | None] = contextvars.ContextVar(
    "pdgate_write_in_flight", default=None
)


class RetryingWriter:
    def __init__(
        self,
        transport: Transport,
        retries: int,
        stats: StatsCollector | None = None,
        gone: Callable[[Write], str] | None = None,
    ) -> None:
        """``gone(w)``: why ``w``'s D can no longer be written ("" when not known)."""
        self._transport = transport
        self._retries = retries
        self._stats = stats or StatsCollector()
        self._gone = gone
        self._lock = threading.Lock()  # the write lanes count concurrently
        self.writes = 0  # writes that succeeded

    def write(self, w: Write) -> None:
        """Send ``w``, retried up to ``retries`` times; raises the last ``TransferError``."""
        token = IN_FLIGHT.set(w)
        try:
            self._attempts(w)
        finally:
            IN_FLIGHT.reset(token)
        with self._lock:
            self.writes += 1

    def _attempts(self, w: Write) -> None:
        for attempt in range(self._retries + 1):
            t0 = time.perf_counter()
            try:
                self._transport.write(w.session, w.src, w.dst, w.lengths)
                return
            except TransferError as exc:
                late = self._transport.late_landing_s
                for part in w.parts:
                    tr = part.task.transfer
                    tr.settle_s = max(tr.settle_s, late)
                if attempt == self._retries:
                    raise
                took = time.perf_counter() - t0  # before asking whether D is gone
                gone = self._gone(w) if self._gone is not None else ""
                self._stats.add("write_retries_skipped" if gone else "write_retries")
                log.warning(
                    "write of %d pieces (%d bytes) to %s failed after %.1fs (%s); %s",
                    len(w.src),
                    sum(w.lengths),
                    w.session,
                    took,
                    exc,
                    f"no retry: {gone}" if gone else f"retry {attempt + 1} of {self._retries}",
                )
                if gone:
                    raise
