"""What the sender thread records on its transfers: writes that landed or failed, and ends.

After a write: its bytes and span on each transfer it carried, their pieces signed (with
``verify``), a first-write callback per transfer; after a failed one: the error, and the D
handshake dropped (the next transfer asks again). At a transfer's end the done or failed signal
goes to D, with the digests, and the end callback runs.
"""

from __future__ import annotations

import logging
import time

from connector import wire
from connector.errors import TransferError
from connector.seal import OPEN, Channel
from connector.stats import StatsCollector
from connector.worker.batch import Write
from connector.worker.handshake import HandshakeCache
from connector.worker.ledger import Ledger
from connector.worker.side_channel import SignalClient
from connector.worker.signing import Signer
from connector.worker.transfer import EndTask, Outcome, Span, Transfer

log = logging.getLogger("pdgate.connector.sender")


def signal_error(error: str) -> str:
    """What D reads of a failed push's reason: its start (``wire.MAX_ERROR_CHARS``)."""
    return error[: wire.MAX_ERROR_CHARS]


class Recorder:
    def __init__(
        self,
        me: str,
        instance: str,
        ledger: Ledger,
        handshakes: HandshakeCache,
        signer: Signer | None,
        on_end: Outcome | None,
        on_first_write: Outcome | None,
        stats: StatsCollector | None = None,
        announce: bool = False,
        channel: Channel = OPEN,
    ) -> None:
        self._me = me  # "<engine id>/<rank>": the signals' sender
        self._instance = instance  # the registry's id of this engine
        self._ledger = ledger
        self._handshakes = handshakes
        self._signer = signer  # with ``verify``
        self._on_end = on_end
        self._on_first_write = on_first_write
        self._signals: SignalClient | None = None
        self._stats = stats or StatsCollector()
        self._announce = announce  # keep-alives on: D hears of a transfer at its first write
        self._channel = channel

    def open(self) -> None:
        """On the sender thread (ZeroMQ sockets stay on the thread that made them)."""
        self._signals = SignalClient(self._channel)

    def close(self) -> None:
        if self._signals is not None:
            self._signals.close()

    def wrote(self, w: Write, span: Span) -> None:
        log.debug(
            "wrote %d pieces, %d bytes to %s in %.3fs",
            len(w.src),
            sum(w.lengths),
            w.session,
            span.end - span.start,
        )
        self._stats.add("push_bytes", sum(w.lengths))
        self._stats.add("push_pieces", len(w.lengths))
        self._stats.add("push_writes")
        for part in w.parts:
            tr = part.task.transfer
            tr.bytes += part.nbytes
            spans = tr.write_spans
            if not spans or spans[-1] is not span:
                spans.append(span)
            if self._signer is not None:
                self._signer.record(tr, part)
            if tr.trace is not None:
                tr.trace.wrote(part.task.pairs, part.task.layer, part.nbytes, span)
            if not tr.announced:
                tr.announced = True
                self._first_write(tr)

    def failed(self, w: Write, exc: TransferError) -> None:
        self._stats.add("write_failures")
        for part in w.parts:
            tr = part.task.transfer
            tr.error = str(exc)
            d = tr.dest
            self._handshakes.forget(d.host, tr.d_port, d.engine_id)

    def end(self, end: EndTask) -> None:
        tr = end.transfer
        # P's own request failing (end.fail) fails the transfer like a failed write: for the
        # signal, the binding event, the ledger's release and the counters alike
        tr.error = tr.error or end.fail
        log.debug("transfer %s ends (%s)", tr.transfer_id, tr.error or "ok")
        assert self._signals is not None
        error = tr.error
        if tr.trace is not None:
            tr.trace.error = error
        digests = self._signer.digests(tr) if self._signer is not None and not error else []
        ahead, last = wire.split_digests(digests)
        for part in ahead:  # on this socket, so D has them before the signal
            if not self._signals.send(tr.dest.host, tr.d_port, self._digests(tr, part)):
                error = tr.error = "digests not sent (side-channel queue full)"
                digests, last = [], []
                break
        sig = wire.Signal(
            tr.transfer_id,
            self._me,
            not error,
            tr.route.expected,
            signal_error(error),
            last,
            min(tr.settle_s, wire.MAX_SETTLE_S),
            self._instance,
            len(digests),
            self._signer is not None,
        )
        if not self._signals.send(tr.dest.host, tr.d_port, sig):
            tr.error = tr.error or "signal not sent"
        tr.ended_at = time.perf_counter()
        self._count_end(tr, tr.error)
        self._ledger.ended(tr)  # counted first: P may free the blocks (and stop stepping) now
        if error:
            log.warning("transfer %s (%s) failed: %s", tr.transfer_id, tr.req_id, error)
        self._ledger.done(end)
        self._notify(self._on_end, tr)

    def _digests(self, tr: Transfer, part: list[wire.Digest]) -> wire.Digests:
        return wire.Digests(tr.transfer_id, self._me, part)

    def _first_write(self, tr: Transfer) -> None:
        """The transfer's first write landed. With keep-alives on, an ``Alive`` for it leaves
        this thread first, before the first-write callback (the ``pushing`` event), so D's
        silence clock runs before anyone can see the push under way. The keep-alive thread's
        own beat for a new transfer waits for the GIL and its 50 ms gap: in a CI run a P
        frozen shortly after ``pushing`` showed had not been named to D, and D waited for its
        load deadline instead of failing the load after ``silence_s``."""
        if self._announce and self._signals is not None:
            self._signals.send(tr.dest.host, tr.d_port, wire.Alive(self._me, [tr.transfer_id]))
        self._notify(self._on_first_write, tr)

    def _count_end(self, tr: Transfer, error: str) -> None:
        stats = self._stats
        stats.add("transfers", label="failed" if error else "ok")
        if tr.settle_s > 0 and not error:  # the ledger's hold (a failed transfer has none)
            stats.add("late_landing_holds", label="prefill")
        if not error and tr.write_spans:
            o = tr.overlap()
            stats.observe("push_seconds", o.push_s)
            stats.observe("push_exposed_seconds", o.exposed_s)

    @staticmethod
    def _notify(callback: Outcome | None, tr: Transfer) -> None:
        if callback is not None:
            try:
                callback(tr)
            except Exception:
                log.exception("transfer callback failed")
