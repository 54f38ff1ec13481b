"""P side sender: waits for each layer's KV-written event, writes D's blocks, signals.

``save_kv_layer`` only queues (layer, chunk, event). The sender thread (loop.py) drains the
queue, waits on each task's event (never a stream sync), turns the chunk's block pairs into
coalesced pieces (batch.py), and issues one batched write per destination (writer.py). Tasks
whose D handshake is still running are parked (not blocked on) and resumed when it ends. After
a transfer's last layer of its last chunk the done signal goes to D (record.py, with digests
from signing.py); on any failure a failed signal goes instead and the rest is dropped.

This module is the forward thread's side: it opens transfers (ledger.py), queues their tasks
and answers whether a request's blocks may be freed.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

from connector import tp
from connector.device import Event, host_checksums
from connector.errors import HandshakeError
from connector.metadata import SendChunk
from connector.seal import OPEN, Channel
from connector.stats import StatsCollector
from connector.transport import Transport
from connector.worker import digest
from connector.worker.batch import Write, check_pairable
from connector.worker.handshake import HandshakeCache, Peer
from connector.worker.keepalive import KeepAlive
from connector.worker.ledger import Ledger
from connector.worker.loop import SenderLoop
from connector.worker.memory import KVMemory
from connector.worker.record import Recorder
from connector.worker.side_channel import handshake, refuses
from connector.worker.signing import Signer
from connector.worker.transfer import EndTask, LayerTask, Outcome, Task, Transfer
from connector.worker.writer import RetryingWriter

__all__ = ["Sender", "SenderCallbacks", "SenderOptions", "Transfer"]


@dataclass(frozen=True, slots=True)
class SenderOptions:
    """Who this P rank is, and how it pushes."""

    engine_id: str
    rank: int
    tp_size: int
    total_kv_heads: int
    use_mla: bool
    handshake_timeout_s: float
    write_retries: int = 1  # a failed batch is written again this many times
    verify: bool = False  # sign every piece written (``verify_kv``, or proof of arrival)
    recheck_sources: bool = True  # with ``verify``: read P's KV again at the end (verify_kv)
    keepalive_s: float = 0.5  # ``Alive`` to D for each open transfer this often (0: never)
    instance_id: str = ""  # the registry's id of this engine, named in its done signals

    @property
    def me(self) -> str:
        """How this rank names itself in its signals."""
        return f"{self.engine_id}/{self.rank}"


@dataclass(frozen=True, slots=True)
class SenderCallbacks:
    """Run on the sender thread; an exception is logged, never raised."""

    on_end: Outcome | None = None  # the transfer's signal went out (done or failed)
    on_first_write: Outcome | None = None  # the transfer's first write landed


def _gone(w: Write) -> str:
    """Why the D rank ``w`` goes to is gone: its side channel refuses connections."""
    tr = w.parts[0].task.transfer
    host, port = tr.dest.host, tr.d_port
    return f"D's side channel at {host}:{port} refuses connections" if refuses(host, port) else ""


class Sender:
    def __init__(
        self,
        transport: Transport,
        memory: KVMemory,
        options: SenderOptions,
        callbacks: SenderCallbacks = SenderCallbacks(),
        *,
        checksums: digest.Checksums = host_checksums,
        wall_clock: Callable[[], float] = time.time,
        stats: StatsCollector | None = None,
        channel: Channel = OPEN,
    ) -> None:
        """``checksums`` reads P's KV for ``verify`` (host or device memory); ``wall_clock``
        is compared with D's load deadline; ``stats`` counts what the push does; ``channel``
        seals what goes to D's side channel (handshakes, signals, keep-alives)."""
        self.options = options
        self.stats = stats or StatsCollector()
        self._memory = memory
        self._ledger = Ledger(self._route)
        self.handshakes = HandshakeCache(
            options.engine_id,
            options.handshake_timeout_s,
            self._wake,
            ask=partial(handshake, channel=channel),
            check=self._pairable,
            stats=self.stats,
        )
        self._transport = transport
        self._writer = RetryingWriter(transport, options.write_retries, self.stats, _gone)
        signer = Signer(checksums, options.recheck_sources) if options.verify else None
        recorder = Recorder(
            options.me,
            options.instance_id,
            self._ledger,
            self.handshakes,
            signer,
            callbacks.on_end,
            callbacks.on_first_write,
            self.stats,
            announce=options.keepalive_s > 0,
            channel=channel,
        )
        self._loop = SenderLoop(
            memory, self._ledger, self.handshakes, self._writer, recorder, wall_clock
        )
        self.keepalive = KeepAlive(options.me, self._ledger, options.keepalive_s, channel)
        self.keepalive.start()
        self._loop.start()

    @property
    def transfers(self) -> dict[str, list[Transfer]]:
        """Per request id: its legs."""
        return self._ledger.transfers

    @property
    def writes(self) -> int:
        """Batched writes that succeeded."""
        return self._writer.writes

    # ---- forward thread -------------------------------------------------------------------
    def transfer(self, chunk: SendChunk) -> list[Transfer]:
        """The request's legs: one per D rank this rank writes into (none: a replica)."""
        return self._ledger.open(chunk)

    def prefetch(self, chunk: SendChunk) -> None:
        """Start the D handshakes early (first layer of the step); never waits."""
        for tr in self.transfer(chunk):
            self.handshakes.get(tr.dest.host, tr.d_port, tr.dest.engine_id)

    def push_layer(self, chunk: SendChunk, layer: int, event: Event) -> None:
        if not chunk.pairs:
            return
        for tr in self.transfer(chunk):
            if not tr.ended:
                self._put(LayerTask(tr, chunk.pairs, layer, event))

    def end(self, req_id: str, fail: str = "") -> None:
        """No more layers for this request: signal each D rank (done, or failed with
        ``fail``)."""
        now = time.perf_counter()  # called after the forward's last layer
        for tr in self._ledger.get(req_id):
            if not tr.ended:
                tr.compute_end = now
                self._put(EndTask(tr, fail))

    def _put(self, task: Task) -> None:
        self._ledger.queued(task)
        self._loop.put(task)

    def settled(self, req_id: str) -> bool:
        """Whether P's blocks of ``req_id`` may be released (``Ledger.settled``)."""
        return self._ledger.settled(req_id)

    def quiet(self, req_id: str) -> bool:
        return self._ledger.quiet(req_id)

    def wait_quiet(self, req_id: str, timeout_s: float) -> bool:
        return self._ledger.wait_quiet(req_id, timeout_s)

    def forget(self, req_id: str) -> None:
        self._ledger.forget(req_id)

    def _route(self, chunk: SendChunk) -> list[tp.Route]:
        o, d = self.options, chunk.dest
        heads = d.num_kv_heads or o.total_kv_heads
        return tp.routes(o.rank, o.tp_size, d.tp_size, heads, d.use_mla)

    def _pairable(self, peer: Peer, host: str) -> None:
        problem = self._transport.session_problem(peer.welcome.session, host)
        if problem is not None:
            raise HandshakeError(problem)
        check_pairable(self._memory, peer)

    def _wake(self) -> None:
        self._loop.wake()

    def close(self) -> None:
        self.keepalive.stop()
        self._loop.stop(2.0)
        self.handshakes.close()
