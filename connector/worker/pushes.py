"""P's save path on a worker rank: each step's chunks and leases handed to the sender.

``PushSide`` takes in what the scheduler half planned for the step (``SendChunk``: the block
pairs of one chunk of a request, ``Abandoned``: a lease whose request vLLM dropped before any
chunk), queues each layer of each chunk behind the event that marks its KV written
(``save_layer``), queues a transfer's end after the step of its last chunk (``end_step``), and
tells the worker half which finished requests' pushes have all ended (``settled``): vLLM keeps
their blocks until then. Preempted requests' pushes are let drain before the forward may reuse
their blocks.

Runs on vLLM's forward thread (the worker half's hooks); the writes and signals are the sender
thread's (sender.py → loop.py → lanes.py → writer.py).
"""

from __future__ import annotations

import logging
import time

from connector.config import ConnectorSettings
from connector.device import Device
from connector.errors import ConfigError
from connector.metadata import ABANDONED, Abandoned, PdgateMetadata, SendChunk
from connector.seal import Channel
from connector.stats import StatsCollector
from connector.tracing import ConnectorTracer, sampled
from connector.transport import Transport
from connector.worker import digest
from connector.worker.memory import KVMemory
from connector.worker.sender import Sender, SenderCallbacks, SenderOptions
from connector.worker.tamper import TamperingTransport
from connector.worker.traces import PushTrace

log = logging.getLogger("pdgate.connector.worker")

PREEMPT_WAIT_S = 30.0


def digests_on(
    settings: ConnectorSettings, transport: Transport, device: Device, rank: int
) -> bool:
    """P signs its pieces with ``verify_kv``, and always when the transport's writes finish
    before they land (the digests then double as D's proof of arrival). NPU memory cannot
    be read for digests: ``verify_kv`` is refused there."""
    s = settings
    lands = transport.lands_on_completion
    if device.name == "npu":
        if s.verify_kv:
            raise ConfigError(
                "verify_kv reads the pushed KV back for checksums, which pdgate cannot do "
                "on npu memory: turn verify_kv off (Mooncake ascend writes land on "
                "completion)"
            )
        if not lands:
            log.warning(
                "rank %d: %s writes finish before the bytes land and npu memory cannot be "
                "checked: D may decode from KV still in flight; use ascend",
                rank,
                s.mooncake_protocol,
            )
        return False
    if s.verify_kv:
        log.info(
            "rank %d: verify_kv on (crc32 of every pushed piece, checked on D; %s memory)",
            rank,
            device.name,
        )
    elif not lands:
        log.info(
            "rank %d: %s writes finish before they land; P signs each piece so that D "
            "waits for its bytes (crc32, checked on D)",
            rank,
            s.mooncake_protocol,
        )
    return s.verify_kv or not lands


class PushSide:
    def __init__(
        self,
        settings: ConnectorSettings,
        transport: Transport,
        memory: KVMemory,
        options: SenderOptions,
        callbacks: SenderCallbacks,
        *,
        checksums: digest.Checksums,
        stats: StatsCollector,
        channel: Channel,
        tracer: ConnectorTracer | None,
    ) -> None:
        """The sender, over ``transport`` (wrapped by the test-only tamperer when
        ``test_corrupt_push`` is on)."""
        self._memory = memory
        self._tracer = tracer
        self.tamper: TamperingTransport | None = None  # TEST ONLY: ``test_corrupt_push``
        if settings.test_corrupt_push:  # TEST ONLY: D gets garbage for a block; see tamper.py
            self.tamper = TamperingTransport(transport, memory.block_bytes, options.me)
            transport = self.tamper
            if options.verify and not settings.verify_kv:  # arrival digests describe the bytes sent
                checksums = self.tamper.sent_checksums(checksums)
        self.sender = Sender(
            transport,
            memory,
            options,
            callbacks,
            checksums=checksums,
            stats=stats,
            channel=channel,
        )
        self._sends: set[str] = set()  # req ids this rank knows as sending
        self._last_queued: set[str] = set()  # req ids whose end (done/failed) is queued
        self._finished: set[str] = set()  # finished on P, waiting for pushes to settle
        self._abandoned: set[str] = set()  # ledger keys of leases closed for dropped requests

    def absorb(self, meta: PdgateMetadata) -> None:
        """Open the step's chunks on the sender, and close its abandoned leases."""
        for chunk in meta.sends:
            log.debug(
                "step: %s pushes %d blocks (last=%s)",
                chunk.transfer_id,
                len(chunk.pairs),
                chunk.last,
            )
            self._sends.add(chunk.req_id)
            self.sender.prefetch(chunk)
            if self._tracer is not None and chunk.traceparent:
                self._trace_push(chunk.req_id, chunk.traceparent)
        for lease in meta.abandoned:
            self._close_lease(lease)

    def _close_lease(self, lease: Abandoned) -> None:
        """A lease whose request vLLM dropped before any chunk came here: D gets a failed end.
        Keyed apart from vLLM's request ids; reported to no one, forgotten once sent."""
        key = f"lease:{lease.transfer_id}"
        chunk = SendChunk(
            key, lease.transfer_id, lease.dest, [], True, ABANDONED, lease.traceparent
        )
        self.sender.prefetch(chunk)
        self.sender.end(key, ABANDONED)
        self._abandoned.add(key)

    def _trace_push(self, req_id: str, traceparent: str) -> None:
        """Trace each leg of a sampled push (a span per D rank written)."""
        parent = sampled(traceparent)
        for tr in self.sender.transfers.get(req_id, ()):
            if tr.trace is None and parent is not None:
                tr.trace = PushTrace(parent, time.time())

    def handle_preemptions(self, meta: PdgateMetadata) -> None:
        """Before the forward may reuse a preempted request's blocks, let its pushes drain."""
        for chunk in meta.sends:
            if chunk.fail and not self.sender.wait_quiet(chunk.req_id, PREEMPT_WAIT_S):
                log.error(
                    "pushes of preempted %s still running after %ss", chunk.req_id, PREEMPT_WAIT_S
                )

    def save_layer(self, meta: PdgateMetadata, layer_name: str, device: Device) -> None:
        """Queue the layer of each chunk of the step, behind the event that marks it written."""
        if not meta.sends:
            return
        layer = self._memory.index().get(layer_name)
        if layer is None:
            return
        event = device.record_event()
        for chunk in meta.sends:
            self.sender.push_layer(chunk, layer, event)

    def end_step(self, meta: PdgateMetadata) -> None:
        """After the step's last layer: queue the end of transfers whose prefill ended."""
        for chunk in meta.sends:
            if chunk.last and chunk.req_id not in self._last_queued:
                self._last_queued.add(chunk.req_id)
                self.sender.end(chunk.req_id, chunk.fail)

    def settled(self, finished_req_ids: set[str]) -> set[str]:
        """Requests whose pushes all ended, among those finished on P (now or before): vLLM
        may free their blocks. One that finished before its last chunk is ended as failed."""
        sending: set[str] = set()
        ended = finished_req_ids & self._sends
        for req_id in ended - self._last_queued:  # aborted before its prefill completed
            self._last_queued.add(req_id)
            self.sender.end(req_id, "prefill request ended before its last chunk")
        self._finished |= ended
        for key in [k for k in self._abandoned if self.sender.settled(k)]:
            self._abandoned.discard(key)
            self.sender.forget(key)
        for req_id in list(self._finished):
            if self.sender.settled(req_id):
                sending.add(req_id)
                self._finished.discard(req_id)
                self._sends.discard(req_id)
                self._last_queued.discard(req_id)
                self.sender.forget(req_id)
        return sending
