"""The sender thread: drain the queue, sort each task, hand the layers that are ready to the
write lanes.

Each round takes every queued task and write outcome (and the tasks parked last round). An
outcome is recorded first (bytes, digests, or the transfer's error) and its layer tasks are
done. A task whose D handshake is still running is parked (with every later task of its
transfer, to keep their order) and taken again when a handshake ends; a task of a failed
transfer is dropped; a layer task past D's deadline, or whose pieces cannot be laid out, fails
its transfer. The others wait on their layer's event (never a stream sync) and join the write
for their D session; a device forward runs ahead of its kernels, so the writes gathered so far
go to their lanes whenever the next layer is still computing. The rest go at the round's end.
An end is signalled once every write of its transfer is reported (parked until then): D must
not hear "done" before the bytes are in, nor "failed" while a write may still be issued.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable

from connector.errors import LayoutError
from connector.worker.batch import Batch, part_of
from connector.worker.handshake import HandshakeCache, Peer
from connector.worker.lanes import Lanes, Written
from connector.worker.ledger import Ledger
from connector.worker.memory import KVMemory
from connector.worker.record import Recorder
from connector.worker.transfer import EndTask, LayerTask, Task, Transfer
from connector.worker.writer import RetryingWriter

log = logging.getLogger("pdgate.connector.sender")


class SenderLoop:
    def __init__(
        self,
        memory: KVMemory,
        ledger: Ledger,
        handshakes: HandshakeCache,
        writer: RetryingWriter,
        recorder: Recorder,
        wall_clock: Callable[[], float],
    ) -> None:
        self._memory = memory
        self._ledger = ledger
        self._handshakes = handshakes
        self._writer = writer
        self._recorder = recorder
        self._wall = wall_clock
        self._queue: queue.SimpleQueue[Task | Written | None] = queue.SimpleQueue()
        self._parked: list[Task] = []
        self._stop = False
        self.lanes = Lanes(writer, self._queue.put, wall_clock)
        self._thread = threading.Thread(target=self._run, name="pdgate-sender", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def put(self, task: Task) -> None:
        self._queue.put(task)

    def wake(self) -> None:
        """Take the parked tasks again (a handshake ended), or notice ``stop``."""
        self._queue.put(None)

    def stop(self, timeout_s: float) -> None:
        self._stop = True
        self.wake()
        self._thread.join(timeout_s)
        self.lanes.stop(timeout_s)

    def _run(self) -> None:
        self._recorder.open()
        while not self._stop:
            written, tasks = self._take()
            try:
                for outcome in written:
                    self._reported(outcome)
                if tasks:
                    self._process(tasks)
            except Exception:
                log.exception("sender batch failed")
        self._recorder.close()

    def _take(self) -> tuple[list[Written], list[Task]]:
        """Wait for the next task, outcome or wake-up, then take everything queued and
        parked."""
        written: list[Written] = []
        tasks = self._parked
        self._parked = []
        item = self._queue.get()
        while True:
            if isinstance(item, Written):
                written.append(item)
            elif item is not None:
                tasks.append(item)
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                return written, tasks

    def _reported(self, outcome: Written) -> None:
        """A lane's outcome: recorded, and its layer tasks are done."""
        w = outcome.write
        if outcome.dropped:
            for part in w.parts:
                tr = part.task.transfer
                tr.error = tr.error or str(outcome.error)
        elif outcome.error is not None:
            self._recorder.failed(w, outcome.error)
        else:
            self._recorder.wrote(w, outcome.span)
        for part in w.parts:
            part.task.transfer.writing -= 1
            self._ledger.done(part.task)

    def _process(self, tasks: list[Task]) -> None:
        batch = Batch()
        ends: list[EndTask] = []
        parked: set[Transfer] = set()  # legs waiting for their handshake this round
        for task in tasks:
            tr = task.transfer
            if tr in parked:
                self._parked.append(task)
                continue
            peer: Peer | Exception | None = None
            if not tr.error:
                peer = self._handshakes.get(tr.dest.host, tr.d_port, tr.dest.engine_id)
                if peer is None:
                    log.debug("transfer %s waits for its handshake", tr.transfer_id)
                    parked.add(tr)
                    self._parked.append(task)
                    continue
                if isinstance(peer, Exception):
                    tr.error = f"handshake: {peer}"
            if isinstance(task, EndTask):
                ends.append(task)
            elif isinstance(peer, Peer) and not tr.error:
                self._add(task, peer, batch)
            else:
                self._ledger.done(task)
        self._flush(batch)
        for end in ends:
            if end.transfer.writing:  # its writes are not all reported yet
                self._parked.append(end)
            else:
                self._recorder.end(end)

    def _add(self, task: LayerTask, peer: Peer, batch: Batch) -> None:
        """Add ``task`` to the write for its D session once its layer is computed."""
        tr = task.transfer
        if tr.dest.deadline and self._wall() >= tr.dest.deadline:
            tr.error = "push deadline passed: D has given up on this transfer"
            self._ledger.done(task)
            return
        try:
            part = part_of(task, peer, self._memory)
        except (LayoutError, KeyError) as exc:
            tr.error = f"layout: {exc}"
            self._ledger.done(task)
            return
        if batch and not task.event.query():
            # a device forward runs ahead of its kernels: write the layers that are done
            # rather than hold them behind one that is still computing
            self._flush(batch)
        task.event.synchronize()
        batch.add(peer.welcome.session, part)

    def _flush(self, batch: Batch) -> None:
        """One write per D session, each to its session's lane; its layer tasks are done
        when the lane reports it (``_reported``)."""
        for w in batch.values():
            for part in w.parts:
                part.task.transfer.writing += 1
            self.lanes.submit(w)
        batch.clear()
