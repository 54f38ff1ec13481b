"""P's keep-alives: while a push is open, D hears from this P rank every ``keepalive_s``.

A thread of its own (with its own ZeroMQ sockets) rather than the sender thread, so a long write
does not read as silence: what D learns is "this P process runs and still has the transfer
open". A P that is killed or frozen (SIGSTOP) stops sending, and D fails the load after
``silence_s`` instead of its whole ``kv_load_timeout_s``.
"""

from __future__ import annotations

import logging
import threading

from connector import wire
from connector.worker.ledger import Ledger
from connector.worker.side_channel import SignalClient

log = logging.getLogger("pdgate.connector.sender")


class KeepAlive:
    def __init__(self, me: str, ledger: Ledger, interval_s: float) -> None:
        self._me = me
        self._ledger = ledger
        self._interval = interval_s
        self._stop = threading.Event()
        self.sent = 0
        self._thread = threading.Thread(target=self._run, name="pdgate-keepalive", daemon=True)

    def start(self) -> None:
        if self._interval > 0:
            self._thread.start()

    def _run(self) -> None:
        client = SignalClient()
        try:
            while not self._stop.wait(self._interval):
                try:
                    self.beat(client)
                except Exception:
                    log.exception("keep-alive failed")
        finally:
            client.close()

    def beat(self, client: SignalClient) -> None:
        """One ``Alive`` per D rank, naming this rank's open transfers to it."""
        by_rank: dict[tuple[str, int], list[str]] = {}
        for tr in self._ledger.open_transfers():
            by_rank.setdefault((tr.dest.host, tr.d_port), []).append(tr.transfer_id)
        for (host, port), tids in by_rank.items():
            if client.send(host, port, wire.Alive(self._me, tids)):
                self.sent += 1

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(2.0)
