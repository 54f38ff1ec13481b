"""P side sender thread: waits for each layer's KV-written event, writes D's blocks, signals.

``save_kv_layer`` only queues (layer, chunk, event). The thread drains the queue, waits on each
task's event (never a stream sync), turns the chunk's block pairs into coalesced pieces, and
issues one batched write per destination. Tasks whose D handshake is still running are parked
(not blocked on) and resumed when it ends. After a transfer's last layer of its last chunk the
done signal goes to D; on any failure a failed signal goes instead and the rest is dropped.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from connector import tp, wire
from connector.device import Event, host_checksums
from connector.errors import LayoutError, TransferError
from connector.layout import Piece, check_compatible, pair_pieces
from connector.metadata import Destination, SendChunk
from connector.transport import Transport
from connector.worker import digest
from connector.worker.handshake import HandshakeCache, Peer
from connector.worker.memory import KVMemory
from connector.worker.overlap import PushOverlap, overlap
from connector.worker.side_channel import SignalClient
from connector.worker.tamper import Tamper

log = logging.getLogger("pdgate.connector.sender")


@dataclass
class Transfer:
    req_id: str
    transfer_id: str
    dest: Destination
    route: tp.Route | None
    queued: int = 0  # tasks not processed yet
    ended: bool = False  # signal sent (done or failed), or nothing to signal
    announced: bool = False  # the first write landed (a "pushing" event went out)
    error: str = ""
    bytes: int = 0
    # pieces of the chunk being pushed, per (P layout, D layout): (pairs object, pieces)
    cached: tuple[object, dict[tuple[int, int], list[Piece]]] | None = None
    written: list[digest.Written] = field(default_factory=list)  # with ``verify``
    # push-overlap bookkeeping (perf_counter): each write's span, P's compute end, signal sent
    write_spans: list[tuple[float, float]] = field(default_factory=list)
    compute_end: float = 0.0
    ended_at: float = 0.0
    tampered: bool = False  # test hook ``test_corrupt_push``: its first block went out wrong
    settle_s: float = 0.0  # a write failed: its pieces may land this long after (see Signal)

    @property
    def d_port(self) -> int:
        assert self.route is not None
        return self.dest.port + self.route.d_rank

    def overlap(self) -> PushOverlap:
        offset = time.time() - time.perf_counter()
        return overlap(self.write_spans, self.compute_end, self.ended_at, offset)


@dataclass(frozen=True, slots=True)
class _Layer:
    transfer: Transfer
    pairs: list[tuple[int, int]]
    layer: int
    event: Event


@dataclass(frozen=True, slots=True)
class _End:
    transfer: Transfer
    fail: str


_Task = _Layer | _End
Outcome = Callable[[Transfer], None]


@dataclass
class _Batch:
    """Pieces bound for one D session, gathered over several layer tasks."""

    src: list[int] = field(default_factory=list)
    dst: list[int] = field(default_factory=list)
    lengths: list[int] = field(default_factory=list)
    tasks: list[tuple[_Layer, int]] = field(default_factory=list)  # (task, its bytes)
    # with ``verify``: id(task) -> (D layer, sources, destinations, lengths) to sign
    signed: dict[int, tuple[int, list[int], list[int], list[int]]] = field(default_factory=dict)


class Sender:
    def __init__(
        self,
        transport: Transport,
        memory: KVMemory,
        rank: int,
        tp_size: int,
        total_kv_heads: int,
        use_mla: bool,
        engine_id: str,
        handshakes_timeout_s: float,
        on_end: Outcome | None = None,
        on_first_write: Outcome | None = None,
        wall_clock: Callable[[], float] = time.time,
        verify: bool = False,
        corrupt: bool = False,
        recheck_sources: bool = True,
        write_retries: int = 1,
        checksums: digest.Checksums = host_checksums,
    ) -> None:
        self._transport = transport
        self._retries = write_retries
        self._verify = verify
        self._checksums = checksums  # reads P's KV for ``verify`` (host or device memory)
        self._recheck = recheck_sources  # second CRC pass at the end (``verify_kv`` only)
        self._memory = memory
        self._rank = rank
        self._tp = tp_size
        self._heads = total_kv_heads
        self._mla = use_mla
        self._me = f"{engine_id}/{rank}"
        # TEST ONLY (``test_corrupt_push``): D gets garbage for a block; see worker/tamper.py
        self._tamper = Tamper(transport, memory.block_bytes, self._me) if corrupt else None
        self._on_end = on_end
        self._on_first_write = on_first_write
        self._wall = wall_clock
        self._queue: queue.SimpleQueue[_Task | None] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._cv = threading.Condition(self._lock)
        self.transfers: dict[str, Transfer] = {}
        self.handshakes = HandshakeCache(
            engine_id, handshakes_timeout_s, self._wake, check=self._pairable
        )
        self._signals: SignalClient | None = None
        self._parked: list[_Task] = []
        self._chunks = 0
        self._stop = False
        self.writes = 0
        self._thread = threading.Thread(target=self._run, name="pdgate-sender", daemon=True)
        self._thread.start()

    # ---- forward thread -------------------------------------------------------------------
    def transfer(self, chunk: SendChunk) -> Transfer:
        with self._lock:
            tr = self.transfers.get(chunk.req_id)
            if tr is None:
                d = chunk.dest
                route = tp.route(
                    self._rank, self._tp, d.tp_size, d.num_kv_heads or self._heads, d.use_mla
                )
                tr = Transfer(chunk.req_id, chunk.transfer_id, d, route)
                self.transfers[chunk.req_id] = tr
                if route is None:
                    tr.ended = True  # a replica: another rank writes these heads
            return tr

    def prefetch(self, chunk: SendChunk) -> None:
        """Start the D handshake early (first layer of the step); never waits."""
        tr = self.transfer(chunk)
        if tr.route is not None:
            self.handshakes.get(tr.dest.host, tr.d_port, tr.dest.engine_id)

    def push_layer(self, chunk: SendChunk, layer: int, event: Event) -> None:
        tr = self.transfer(chunk)
        if tr.route is None or tr.ended or not chunk.pairs:
            return
        self._put(_Layer(tr, chunk.pairs, layer, event))

    def end(self, req_id: str, fail: str = "") -> None:
        """No more layers for this transfer: signal D (done, or failed with ``fail``)."""
        with self._lock:
            tr = self.transfers.get(req_id)
        if tr is None or tr.route is None or tr.ended:
            return
        tr.compute_end = time.perf_counter()  # called after the forward's last layer
        self._put(_End(tr, fail))

    def _put(self, task: _Task) -> None:
        with self._lock:
            task.transfer.queued += 1
        self._queue.put(task)

    def settled(self, req_id: str) -> bool:
        """Whether P's blocks of ``req_id`` may be released: every push from them has ended,
        and no abandoned write can still read them (``settle_s`` after the end)."""
        with self._lock:
            tr = self.transfers.get(req_id)
            if tr is None:
                return True
            if tr.queued or not tr.ended:
                return False
            return not tr.settle_s or time.perf_counter() >= tr.ended_at + tr.settle_s

    def quiet(self, req_id: str) -> bool:
        with self._lock:
            tr = self.transfers.get(req_id)
            return tr is None or tr.queued == 0

    def wait_quiet(self, req_id: str, timeout_s: float) -> bool:
        with self._cv:
            return self._cv.wait_for(lambda: self._quiet_locked(req_id), timeout_s)

    def _quiet_locked(self, req_id: str) -> bool:
        tr = self.transfers.get(req_id)
        return tr is None or tr.queued == 0

    def forget(self, req_id: str) -> None:
        with self._lock:
            self.transfers.pop(req_id, None)

    def _wake(self) -> None:
        self._queue.put(None)

    # ---- sender thread --------------------------------------------------------------------
    def _run(self) -> None:
        self._signals = SignalClient()
        while not self._stop:
            first = self._queue.get()
            tasks = self._parked
            self._parked = []
            if first is not None:
                tasks.append(first)
            while True:
                try:
                    nxt = self._queue.get_nowait()
                except queue.Empty:
                    break
                if nxt is not None:
                    tasks.append(nxt)
            if tasks:
                try:
                    self._process(tasks)
                except Exception:
                    log.exception("sender batch failed")
        self._signals.close()

    def _process(self, tasks: list[_Task]) -> None:
        batches: dict[str, _Batch] = {}  # per D session: the pieces ready to write
        ends: list[_End] = []
        parked_tids: set[str] = set()
        for task in tasks:
            tr = task.transfer
            if tr.transfer_id in parked_tids:
                self._parked.append(task)
                continue
            if tr.error:
                if isinstance(task, _End):
                    ends.append(task)
                else:
                    self._done(task)
                continue
            hs = self.handshakes.get(tr.dest.host, tr.d_port, tr.dest.engine_id)
            if hs is None:
                log.debug("transfer %s waits for its handshake", tr.transfer_id)
                parked_tids.add(tr.transfer_id)
                self._parked.append(task)
                continue
            if isinstance(hs, Exception):
                tr.error = f"handshake: {hs}"
                if isinstance(task, _End):
                    ends.append(task)
                else:
                    self._done(task)
                continue
            if isinstance(task, _End):
                ends.append(task)
                continue
            if tr.dest.deadline and self._wall() >= tr.dest.deadline:
                tr.error = "push deadline passed: D has given up on this transfer"
                self._done(task)
                continue
            try:
                src, dst, lengths = self._pieces(task, hs)
            except (LayoutError, KeyError) as exc:
                tr.error = f"layout: {exc}"
                self._done(task)
                continue
            if batches and not task.event.query():
                # a device forward runs ahead of its kernels: write the layers that are done
                # rather than hold them behind one that is still computing
                self._flush(batches)
            task.event.synchronize()
            b = batches.setdefault(hs.welcome.session, _Batch())
            if self._verify:
                d_layer = hs.layer_index[self._memory.layer_names[task.layer]]
                b.signed[id(task)] = (d_layer, src, dst, lengths)
            if self._tamper is not None and task.layer == 0 and not tr.tampered:
                tr.tampered = True  # ``signed`` keeps the true pieces: verify_kv signs P's KV
                src, dst, lengths = self._tamper.apply(src, dst, lengths)
                if self._verify and not self._recheck:  # arrival digests: what was sent
                    b.signed[id(task)] = (b.signed[id(task)][0], src, dst, lengths)
            b.src.extend(src)
            b.dst.extend(dst)
            b.lengths.extend(lengths)
            b.tasks.append((task, sum(lengths)))
        self._flush(batches)
        for end in ends:
            self._signal(end)

    def _flush(self, batches: dict[str, _Batch]) -> None:
        """One write per D session; then the layer tasks in it are done (ok or failed)."""
        for session, b in batches.items():
            try:
                t0 = time.perf_counter()
                self._write(session, b.src, b.dst, b.lengths, b.tasks)
                span = (t0, time.perf_counter())
                self.writes += 1
                log.debug(
                    "wrote %d pieces, %d bytes to %s in %.3fs",
                    len(b.src),
                    sum(b.lengths),
                    session,
                    span[1] - t0,
                )
                for t, n in b.tasks:
                    t.transfer.bytes += n
                    spans = t.transfer.write_spans
                    if not spans or spans[-1] is not span:
                        spans.append(span)
                    if self._verify:
                        self._record(t.transfer, *b.signed[id(t)])
                    if not t.transfer.announced:
                        t.transfer.announced = True
                        self._notify(self._on_first_write, t.transfer)
            except TransferError as exc:
                for t, _ in b.tasks:
                    t.transfer.error = str(exc)
                    d = t.transfer.dest
                    self.handshakes.forget(d.host, t.transfer.d_port, d.engine_id)
            for t, _ in b.tasks:
                self._done(t)
        batches.clear()

    def _write(
        self,
        session: str,
        src: list[int],
        dst: list[int],
        lengths: list[int],
        layer_tasks: list[tuple[_Layer, int]],
    ) -> None:
        """One batch, retried on failure: the same bytes to the same places. A failed attempt
        may still land later (``Transport.late_landing_s``), so its transfers tell D to hold
        their blocks that long before decoding from them or freeing them."""
        for attempt in range(self._retries + 1):
            t0 = time.perf_counter()
            try:
                self._transport.write(session, src, dst, lengths)
                return
            except TransferError as exc:
                late = self._transport.late_landing_s
                for t, _ in layer_tasks:
                    t.transfer.settle_s = max(t.transfer.settle_s, late)
                if attempt == self._retries:
                    raise
                log.warning(
                    "write of %d pieces (%d bytes) to %s failed after %.1fs (%s); retry %d of %d",
                    len(src),
                    sum(lengths),
                    session,
                    time.perf_counter() - t0,
                    exc,
                    attempt + 1,
                    self._retries,
                )

    def _pairable(self, peer: Peer) -> None:
        """Refuse, at the handshake, a D whose KV this P cannot write: a layer D lacks, or a
        layout that cannot be paired (block size, dtype, bytes per token-head)."""
        mem = self._memory
        missing = [n for n in mem.layer_names if n not in peer.layer_index]
        if missing:
            raise LayoutError(
                f"D has no KV layer {missing[0]!r} ({len(missing)} of P's "
                f"{len(mem.layer_names)} layers missing)"
            )
        for layer, name in enumerate(mem.layer_names):
            try:
                check_compatible(mem.layout(layer), peer.welcome.layout(peer.layer_index[name]))
            except LayoutError as exc:
                raise LayoutError(f"layer {name}: {exc}") from None

    def _pieces(self, task: _Layer, hs: Peer) -> tuple[list[int], list[int], list[int]]:
        tr = task.transfer
        assert tr.route is not None
        mem = self._memory
        name = mem.layer_names[task.layer]
        d_index = hs.layer_index[name]
        key = (mem.layer_layout[task.layer], hs.welcome.layer_layouts[d_index])
        if tr.cached is None or tr.cached[0] is not task.pairs:
            tr.cached = (task.pairs, {})
        pieces = tr.cached[1].get(key)
        if pieces is None:
            heads = (0, tr.route.num_heads)
            pieces = pair_pieces(
                mem.layouts[key[0]],
                hs.welcome.layouts[key[1]],
                task.pairs,
                heads,
                tr.route.d_head_start,
            )
            tr.cached[1][key] = pieces
        src_bases = mem.bases[task.layer]
        dst_bases = hs.welcome.layer_bases[d_index]
        return (
            [src_bases[p.plane] + p.src for p in pieces],
            [dst_bases[p.plane] + p.dst for p in pieces],
            [p.length for p in pieces],
        )

    def _record(
        self, tr: Transfer, d_layer: int, src: list[int], dst: list[int], lengths: list[int]
    ) -> None:
        crcs = self._checksums(list(zip(src, lengths, strict=True)))
        for s, d, n, c in zip(src, dst, lengths, crcs, strict=True):
            tr.written.append((d_layer, s, d, n, c))

    def _digests(self, tr: Transfer) -> list[tuple[int, int, int, int]]:
        if not self._recheck:  # digests as proof of arrival: the CRCs taken at write time
            return [(layer, dst, n, c) for layer, _, dst, n, c in tr.written]
        digests, changed = digest.sign(tr.written, self._checksums)
        if changed:
            layer, src, _, n, _ = changed[0]
            log.error(
                "transfer %s (%s): %d pushed piece(s) of P's KV changed after the push, first "
                "D layer #%d at P %#x+%d: a block was pushed before its KV was final or reused",
                tr.transfer_id,
                tr.req_id,
                len(changed),
                layer,
                src,
                n,
            )
        return digests

    def _signal(self, end: _End) -> None:
        tr = end.transfer
        log.debug("transfer %s ends (%s)", tr.transfer_id, tr.error or end.fail or "ok")
        assert tr.route is not None and self._signals is not None
        error = tr.error or end.fail
        digests = self._digests(tr) if self._verify and not error else []
        sig = wire.Signal(
            tr.transfer_id, self._me, not error, tr.route.expected, error, digests, tr.settle_s
        )
        if not self._signals.send(tr.dest.host, tr.d_port, sig):
            tr.error = tr.error or "signal not sent"
        tr.ended_at = time.perf_counter()
        with self._lock:
            tr.ended = True
        if error:
            log.warning("transfer %s (%s) failed: %s", tr.transfer_id, tr.req_id, error)
        self._done(end)
        self._notify(self._on_end, tr)

    @staticmethod
    def _notify(callback: Outcome | None, tr: Transfer) -> None:
        if callback is not None:
            try:
                callback(tr)
            except Exception:
                log.exception("transfer callback failed")

    def _done(self, task: _Task) -> None:
        with self._cv:
            task.transfer.queued -= 1
            self._cv.notify_all()

    def close(self) -> None:
        self._stop = True
        self._wake()
        self._thread.join(2.0)
        self.handshakes.close()
