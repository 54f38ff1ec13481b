"""The worker half: P ranks push (``Sender``), D ranks receive (``RecvTracker``)."""

from __future__ import annotations

import logging
import secrets
import time
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any
from urllib.parse import urlparse

from connector import wire
from connector.compat import features
from connector.config import ConnectorSettings
from connector.device import Device, make_device
from connector.errors import ConfigError
from connector.metadata import ABANDONED, Abandoned, PdgateMetadata, SendChunk
from connector.seal import OVERHEAD, channel_of
from connector.stats import StatsCollector
from connector.tracing import ConnectorTracer, Value, build_tracer, sampled
from connector.transport import Transport, make_transport
from connector.untrusted import shown
from connector.worker import digest
from connector.worker.memory import KVMemory
from connector.worker.receiver import RecvTracker
from connector.worker.sender import Sender, SenderCallbacks, SenderOptions, Transfer
from connector.worker.side_channel import SideChannelServer
from connector.worker.tamper import TamperingTransport
from connector.worker.traces import LoadTraces, PushTrace
from connector.worker.transfer import overlap_of
from pdwire.client import BackgroundWriter, MetaserverClient
from pdwire.models import BindingState, EventDetail
from pdwire.version import PROTOCOL_VERSION, mismatch

if TYPE_CHECKING:
    from vllm.config import VllmConfig

log = logging.getLogger("pdgate.connector.worker")

PREEMPT_WAIT_S = 30.0


class ConnectorWorker:
    def __init__(
        self,
        vllm_config: VllmConfig | None,
        settings: ConnectorSettings,
        *,
        rank: int | None = None,
        tp_size: int | None = None,
        engine_id: str | None = None,
        total_kv_heads: int | None = None,
        use_mla: bool | None = None,
        block_size: int | None = None,
        role: str | None = None,
        recompute: bool | None = None,
        transport: Transport | None = None,
        device: Device | None = None,
        events: BackgroundWriter | None = None,
        clock: Callable[[], float] = time.monotonic,
        tracer: ConnectorTracer | None = None,
    ) -> None:
        """vLLM passes ``vllm_config``; tests may pass the identity keywords instead.
        ``tracer``: spans of traced transfers (built from the settings when not given)."""
        self.settings = settings
        if vllm_config is not None:
            from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

            kv = vllm_config.kv_transfer_config
            assert kv is not None and vllm_config.model_config is not None
            rank = get_tensor_model_parallel_rank() if rank is None else rank
            tp_size = vllm_config.parallel_config.tensor_parallel_size
            engine_id = str(kv.engine_id)
            total_kv_heads = vllm_config.model_config.get_total_num_kv_heads()
            use_mla = bool(vllm_config.model_config.use_mla)
            block_size = vllm_config.cache_config.block_size
            role = kv.kv_role
            recompute = getattr(kv, "kv_load_failure_policy", "fail") == "recompute"
        assert rank is not None and tp_size is not None and engine_id is not None
        self.rank, self.tp_size, self.engine_id = rank, tp_size, engine_id
        http_port = urlparse(settings.http_url).port if settings.http_url else None
        self.actor = settings.resolved_instance_id(http_port)  # as the scheduler half names it
        self.total_kv_heads = total_kv_heads or 1
        self.use_mla = bool(use_mla)
        self.block_size = block_size  # vLLM's block (None: the caches' own)
        self.role = role or "kv_both"
        self.recompute = bool(recompute)  # vLLM recomputes a failed load (else fails it)
        self.stats = StatsCollector()
        self.epoch = secrets.token_hex(8)
        self.protocol = PROTOCOL_VERSION  # what this rank speaks in its handshakes
        self.device = device or make_device(settings.device)
        # seals every side-channel frame with the deployment's secret (none: unauthenticated)
        self.channel = channel_of(
            settings.side_channel_secret_file, settings.side_channel_max_skew_s
        )
        if not self.channel.authenticated:  # insecure_side_channel: said at every start
            log.warning(
                "rank %d: the P <-> D side channel is not authenticated (insecure_side_channel, "
                "no side_channel_secret_file): whoever reaches port %d can forge done signals "
                "and read this engine's KV memory map",
                rank,
                settings.side_channel_port + rank,
            )
        self._transport = transport
        self._clock = clock
        self._events = events
        if events is None and settings.metaserver_url and rank == 0:
            self._events = BackgroundWriter(
                MetaserverClient(settings.metaserver_url, token=settings.token)
            )
        self.memory: KVMemory | None = None
        self.sender: Sender | None = None
        self.tamper: TamperingTransport | None = None  # TEST ONLY: ``test_corrupt_push``
        self.server: SideChannelServer | None = None
        self.tracker = RecvTracker(
            settings.kv_load_timeout_s,
            clock,
            landing_wait_s=settings.landing_wait_s,
            # the scheduler quarantines what a silent P may still write only where vLLM hands
            # the connector its KV cache manager
            silence_s=settings.silence_s if features().bind_manager else 0.0,
            stats=self.stats,
        )
        self.tracker.on_landed = self._count_landed
        if tracer is None:
            resource: dict[str, Value] = {
                "pdgate.instance_id": self.actor,
                "pdgate.rank": rank,
                "pdgate.role": self.role,
            }
            tracer = build_tracer(settings.otlp_traces_endpoint, resource)
        self.tracer = tracer
        self._loads = LoadTraces(tracer) if tracer is not None else None
        self._absorbed: PdgateMetadata | None = None
        self._sends: set[str] = set()  # req ids this rank knows as sending
        self._last_queued: set[str] = set()  # req ids whose end (done/failed) is queued
        self._finished: set[str] = set()  # finished on P, waiting for pushes to settle
        self._abandoned: set[str] = set()  # ledger keys of leases closed for dropped requests
        self._recv_blocks: dict[str, list[int]] = {}  # D: the blocks each expected load fills
        self._ended_blocks: dict[str, list[int]] = {}  # ... of the loads the last poll ended

    @property
    def transport(self) -> Transport:
        if self._transport is None:
            s = self.settings
            self._transport = make_transport(
                s.transport,
                s.resolved_host(),
                s.mooncake_protocol,
                s.device_name,
                s.write_timeout_s,
            )
        return self._transport

    # ---- setup ----------------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: Mapping[str, Any]) -> None:
        self._kv_caches = dict(kv_caches)  # registered memory must outlive us, whoever owns it
        self.memory = KVMemory.of(kv_caches, self.block_size)
        self.memory.register(self.transport)
        verify = self._digests_on()
        log.info(
            "rank %d registered %d KV layers (%s) with %s",
            self.rank,
            len(self.memory.layer_names),
            self.memory.summary(),
            self.transport.session,
        )
        if self.role in ("kv_consumer", "kv_both"):
            self._check_welcome_fits()
            if self.device.name != "npu":  # check whatever digests P ranks send
                memory, checksums = self.memory, self.device.checksums
                self.tracker.verify = lambda sig: digest.check(memory, sig.digests, checksums)
                self.tracker.require_digests = self.settings.verify_kv
            port = self.settings.side_channel_port + self.rank
            self.server = SideChannelServer(
                self.settings.side_channel_host or "0.0.0.0",
                port,
                self._welcome,
                self.tracker.on_signal if self._loads is None else self._on_signal,
                self.tracker.on_alive,
                self.channel,
                self.tracker.on_digests,
            )
        if self.role in ("kv_producer", "kv_both"):
            self.sender = self._make_sender(self.memory, verify)

    def _make_sender(self, memory: KVMemory, verify: bool) -> Sender:
        s = self.settings
        options = SenderOptions(
            engine_id=self.engine_id,
            rank=self.rank,
            tp_size=self.tp_size,
            total_kv_heads=self.total_kv_heads,
            use_mla=self.use_mla,
            handshake_timeout_s=s.handshake_timeout_s,
            write_retries=s.write_retries,
            verify=verify,
            recheck_sources=s.verify_kv,
            keepalive_s=s.keepalive_s,
            instance_id=self.actor,
        )
        transport: Transport = self.transport
        checksums: digest.Checksums = self.device.checksums
        if s.test_corrupt_push:  # TEST ONLY: D gets garbage for a block; see worker/tamper.py
            self.tamper = TamperingTransport(transport, memory.block_bytes, options.me)
            transport = self.tamper
            if verify and not s.verify_kv:  # arrival digests describe the bytes sent
                checksums = self.tamper.sent_checksums(checksums)
        callbacks = SenderCallbacks(on_end=self._report_end, on_first_write=self._report_pushing)
        return Sender(
            transport,
            memory,
            options,
            callbacks,
            checksums=checksums,
            stats=self.stats,
            channel=self.channel,
        )

    def _digests_on(self) -> bool:
        """P signs its pieces with ``verify_kv``, and always when the transport's writes finish
        before they land (the digests then double as D's proof of arrival). NPU memory cannot
        be read for digests: ``verify_kv`` is refused there."""
        s = self.settings
        lands = self.transport.lands_on_completion
        if self.device.name == "npu":
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
                    self.rank,
                    s.mooncake_protocol,
                )
            return False
        if s.verify_kv:
            log.info(
                "rank %d: verify_kv on (crc32 of every pushed piece, checked on D; %s memory)",
                self.rank,
                self.device.name,
            )
        elif not lands:
            log.info(
                "rank %d: %s writes finish before they land; P signs each piece so that D "
                "waits for its bytes (crc32, checked on D)",
                self.rank,
                s.mooncake_protocol,
            )
        return s.verify_kv or not lands

    def _check_welcome_fits(self) -> None:
        """D's handshake answer describes every layer: refuse to start rather than serve an
        answer no P would read (``wire.MAX_FRAME_BYTES``)."""
        size = len(wire.encode(self._welcome(wire.Hello(self.engine_id, self.protocol)))) + OVERHEAD
        if size > wire.MAX_FRAME_BYTES:
            raise ConfigError(
                f"this engine's side-channel Welcome (its KV memory map: "
                f"{len(self.memory.layer_names) if self.memory else 0} layers) takes {size} "
                f"bytes, more than the {wire.MAX_FRAME_BYTES} a side-channel frame may"
            )

    def _welcome(self, hello: wire.Hello) -> wire.Welcome | wire.Refused:
        if self.memory is None:
            return wire.Refused("KV caches not registered yet", self.protocol)
        why = mismatch(hello.protocol, f"P engine {shown(hello.p_engine_id)}", self.protocol)
        if why is not None:
            log.warning("rank %d refuses a handshake: %s", self.rank, why)
            return wire.Refused(why, self.protocol)
        return wire.Welcome(
            engine_id=self.engine_id,
            epoch=self.epoch,
            tp_rank=self.rank,
            tp_size=self.tp_size,
            session=self.transport.session,
            layer_names=self.memory.layer_names,
            layer_bases=self.memory.bases,
            layouts=self.memory.layouts,
            layer_layouts=self.memory.layer_layout,
            protocol=self.protocol,
        )

    # ---- per step -------------------------------------------------------------------------
    def _absorb(self, meta: PdgateMetadata) -> None:
        """Take in a step's metadata once (whichever hook sees it first)."""
        if meta is self._absorbed:
            return
        self._absorbed = meta
        for recv in meta.recvs:
            self.tracker.expect(recv.req_id, recv.transfer_id)
            self._recv_blocks[recv.req_id] = recv.block_ids[recv.load_from :]
            if self._loads is not None and (parent := sampled(recv.traceparent)) is not None:
                blocks = len(recv.block_ids) - recv.load_from
                self._loads.open(parent, recv.req_id, recv.transfer_id, blocks)
        for req_id in meta.failed_recvs:
            self.tracker.fail(req_id)
        if meta.released_recvs:
            self.tracker.release(meta.released_recvs)
        if self.sender is not None:
            for chunk in meta.sends:
                log.debug(
                    "step: %s pushes %d blocks (last=%s)",
                    chunk.transfer_id,
                    len(chunk.pairs),
                    chunk.last,
                )
                self._sends.add(chunk.req_id)
                self.sender.prefetch(chunk)
                if self.tracer is not None and chunk.traceparent:
                    self._trace_push(chunk.req_id, chunk.traceparent)
            for lease in meta.abandoned:
                self._close_lease(lease)

    def _close_lease(self, lease: Abandoned) -> None:
        """A lease whose request vLLM dropped before any chunk came here: D gets a failed end.
        Keyed apart from vLLM's request ids; reported to no one, forgotten once sent."""
        assert self.sender is not None
        key = f"lease:{lease.transfer_id}"
        chunk = SendChunk(
            key, lease.transfer_id, lease.dest, [], True, ABANDONED, lease.traceparent
        )
        self.sender.prefetch(chunk)
        self.sender.end(key, ABANDONED)
        self._abandoned.add(key)

    def handle_preemptions(self, meta: PdgateMetadata) -> None:
        """Before the forward may reuse a preempted request's blocks, let its pushes drain."""
        self._absorb(meta)
        if self.sender is None:
            return
        for chunk in meta.sends:
            if chunk.fail and not self.sender.wait_quiet(chunk.req_id, PREEMPT_WAIT_S):
                log.error(
                    "pushes of preempted %s still running after %ss", chunk.req_id, PREEMPT_WAIT_S
                )

    def start_step(self, meta: PdgateMetadata) -> None:
        self._absorb(meta)

    def save_layer(self, meta: PdgateMetadata, layer_name: str) -> None:
        self._absorb(meta)
        if self.sender is None or not meta.sends or self.memory is None:
            return
        layer = self.memory.index().get(layer_name)
        if layer is None:
            return
        event = self.device.record_event()
        for chunk in meta.sends:
            self.sender.push_layer(chunk, layer, event)

    def end_step(self, meta: PdgateMetadata) -> None:
        """After the step's last layer: queue the end of transfers whose prefill ended."""
        self._absorb(meta)
        if self.sender is None:
            return
        for chunk in meta.sends:
            if chunk.last and chunk.req_id not in self._last_queued:
                self._last_queued.add(chunk.req_id)
                self.sender.end(chunk.req_id, chunk.fail)

    def transfer_results(self, finished_req_ids: set[str]) -> tuple[set[str], set[str], set[str]]:
        sending: set[str] = set()
        if self.sender is not None:
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
        self.tracker.aborted(finished_req_ids)
        recving, failed = self.tracker.poll()
        if self._loads is not None:
            self._loads.ended(recving, failed)
        if failed and self.recompute:
            self.stats.add("recomputes", len(failed))
        self._ended_blocks = {r: self._recv_blocks.pop(r, []) for r in recving}
        for req_id, source in self.tracker.take_sources().items():
            blocks = len(self._ended_blocks.get(req_id, ()))
            if source.intact:
                self.stats.add("blocks_pushed", blocks, label=source.prefill)
            elif self.recompute:
                self.stats.add("blocks_recomputed", blocks, label=source.prefill)
        return sending, recving, failed

    def silent_loads(self) -> frozenset[str]:
        """Loads failed (this step) because P went silent (see ``RecvTracker.take_silent``)."""
        return frozenset(self.tracker.take_silent())

    def ready_loads(self) -> dict[str, float]:
        """Loads that ended intact since the last call, with when their KV was all there."""
        return self.tracker.take_ready()

    def _count_landed(self, req_id: str) -> None:
        """A load ended intact: its blocks hold P's KV now."""
        blocks = len(self._recv_blocks.get(req_id, ()))
        if blocks and self.memory is not None:
            self.stats.add("recv_blocks", blocks)
            self.stats.add("recv_bytes", blocks * self.memory.bytes_per_block)

    def blocks_of(self, req_ids: set[str]) -> set[int]:
        """The blocks the loads of ``req_ids`` were to fill, for loads the last
        ``transfer_results`` ended (vLLM before 0.32 learns of failed loads by block)."""
        return {b for r in req_ids for b in self._ended_blocks.get(r, ())}

    def _report_pushing(self, tr: Transfer) -> None:
        """A leg's first write landed: "pushing" once per request (its first leg to land)."""
        if self._events is not None and not any(leg.announced for leg in tr.legs if leg is not tr):
            detail = EventDetail(bytes_pushed=tr.bytes)
            self._events.post_event(tr.transfer_id, BindingState.PUSHING, self.actor, detail)

    def _on_signal(self, sig: wire.Signal) -> None:
        self.tracker.on_signal(sig)
        assert self._loads is not None
        self._loads.signal(sig)

    def _trace_push(self, req_id: str, traceparent: str) -> None:
        """Trace each leg of a sampled push (a span per D rank written)."""
        assert self.sender is not None
        parent = sampled(traceparent)
        for tr in self.sender.transfers.get(req_id, ()):
            if tr.trace is None and parent is not None:
                tr.trace = PushTrace(parent, time.time())

    def _report_end(self, tr: Transfer) -> None:
        """A leg's signal went out; once every leg's has, the request's outcome goes to the
        metaserver: failed if any leg failed, with the bytes of all of them."""
        if tr.trace is not None and self.tracer is not None:
            assert self.sender is not None
            tr.trace.emit(self.tracer, tr, self.sender.options.me)
        if self._events is None or not tr.all_ended():
            return
        pushed = sum(leg.bytes for leg in tr.legs)
        error = next((leg.error for leg in tr.legs if leg.error), "")
        if error:
            detail = EventDetail(error=error[:4000], bytes_pushed=pushed)
            self._events.post_event(tr.transfer_id, BindingState.FAILED, self.actor, detail)
        else:
            overlap = overlap_of(tr.legs).message()
            detail = EventDetail(bytes_pushed=pushed, message=overlap)
            self._events.post_event(tr.transfer_id, BindingState.DONE, self.actor, detail)

    def shutdown(self) -> None:
        if self.sender is not None:
            self.sender.close()
        if self.tracer is not None:
            self.tracer.shutdown()
        if self.server is not None:
            self.server.close()
        if self._events is not None:
            self._events.close(1.0)
        if self._transport is not None:
            self._transport.close()
