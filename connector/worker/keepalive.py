"""P's keep-alives: while a push is open, D hears from this P rank every ``keepalive_s``.

A thread of its own (with its own ZeroMQ sockets) rather than the sender thread, so a long write
does not read as silence: what D learns is "this P process runs and still has the transfer
open". A P that is killed or frozen (SIGSTOP) stops sending, and D fails the load after
``silence_s`` instead of its whole ``kv_load_timeout_s``.

D starts its silence clock at P's first keep-alive for a transfer (before it, D cannot tell a
P that has not started from one that stopped), so a new transfer is announced at once
(``poke``, from the ledger), not up to ``keepalive_s`` later: a P frozen right after its
first write is then caught by ``silence_s`` too. Beats are at least ``MIN_GAP_S`` apart
whatever the rate of new transfers. This thread's beat waits for the GIL, so the sender thread
names each transfer to D once more as its first write lands (``Recorder._first_write``).
"""

from __future__ import annotations

import logging
import threading
import time

from connector import wire
from connector.seal import OPEN, Channel
from connector.worker.ledger import Ledger
from connector.worker.side_channel import SignalClient

log = logging.getLogger("pdgate.connector.sender")

MIN_GAP_S = 0.05  # between two beats, however many transfers open


class KeepAlive:
    def __init__(self, me: str, ledger: Ledger, interval_s: float, channel: Channel = OPEN) -> None:
        self._channel = channel
        self._me = me
        self._ledger = ledger
        self._interval = interval_s
        self._stop = False
        self._wake = threading.Event()  # set by ``poke`` and ``stop``
        self.sent = 0
        self._thread = threading.Thread(target=self._run, name="pdgate-keepalive", daemon=True)

    def start(self) -> None:
        if self._interval > 0:
            self._ledger.on_open = self.poke
            self._thread.start()

    def poke(self) -> None:
        """A transfer was opened: beat now (not at the next interval)."""
        self._wake.set()

    def _run(self) -> None:
        client = SignalClient(self._channel)
        gap = min(MIN_GAP_S, self._interval)
        try:
            while True:
                self._wake.wait(self._interval - gap)
                self._wake.clear()
                if self._stop:
                    return
                try:
                    self.beat(client)
                except Exception:
                    log.exception("keep-alive failed")
                time.sleep(gap)
        finally:
            client.close()

    def beat(self, client: SignalClient) -> None:
        """One ``Alive`` per D rank, naming this rank's open transfers to it."""
        by_rank: dict[tuple[str, int], list[str]] = {}
        for tr in self._ledger.open_transfers():
            by_rank.setdefault((tr.dest.host, tr.d_port), []).append(tr.transfer_id)
        n = wire.MAX_ALIVE_IDS
        for (host, port), tids in by_rank.items():
            for start in range(0, len(tids), n):  # as many as D reads in one
                if client.send(host, port, wire.Alive(self._me, tids[start : start + n])):
                    self.sent += 1

    def stop(self) -> None:
        self._ledger.on_open = None
        self._stop = True
        self._wake.set()
        if self._thread.is_alive():
            self._thread.join(2.0)
