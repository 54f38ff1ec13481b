"""The worker half: the API vLLM calls on each TP rank, over P's and D's paths.

``ConnectorWorker`` reads the rank's identity and builds what both paths share (transport,
device, side-channel sealing, stats, tracer, the metaserver writer). Once vLLM registers the KV
caches: on D, the side-channel server, answering P's handshakes with this rank's KV memory map
(welcome.py); on P, the sender. Each hook takes in the step's metadata once, whichever sees it
first: P's chunks and leases go to ``PushSide`` (pushes.py), D's loads to ``LoadSide``
(loads.py); ``transfer_results`` asks both which requests ended. What P's pushes did goes to
the metaserver as binding events (``pushing``, ``done``, ``failed``).

vLLM's forward thread runs it, but for the push reports (``_report_pushing``,
``_report_end``): the sender thread calls them back.
"""

from __future__ import annotations

import logging
import secrets
import time
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any
from urllib.parse import urlparse

from connector.config import ConnectorSettings
from connector.device import Device, make_device
from connector.metadata import PdgateMetadata
from connector.seal import channel_of
from connector.stats import StatsCollector
from connector.tracing import ConnectorTracer, Value, build_tracer
from connector.transport import Transport, make_transport
from connector.worker.loads import LoadSide
from connector.worker.memory import KVMemory
from connector.worker.pushes import PushSide, digests_on
from connector.worker.sender import Sender, SenderCallbacks, SenderOptions, Transfer
from connector.worker.side_channel import SideChannelServer
from connector.worker.tamper import TamperingTransport
from connector.worker.transfer import overlap_of
from connector.worker.welcome import Welcomer
from pdwire.client import BackgroundWriter, MetaserverClient
from pdwire.models import BindingState, EventDetail
from pdwire.version import PROTOCOL_VERSION

if TYPE_CHECKING:
    from vllm.config import VllmConfig

log = logging.getLogger("pdgate.connector.worker")


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
        self.server: SideChannelServer | None = None
        if tracer is None:
            resource: dict[str, Value] = {
                "pdgate.instance_id": self.actor,
                "pdgate.rank": rank,
                "pdgate.role": self.role,
            }
            tracer = build_tracer(settings.otlp_traces_endpoint, resource)
        self.tracer = tracer
        self._loads = LoadSide(settings, self.stats, tracer, clock)  # D's path
        self.tracker = self._loads.tracker
        self._pushes: PushSide | None = None  # P's path, once the KV caches are registered
        self._absorbed: PdgateMetadata | None = None

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

    @property
    def sender(self) -> Sender | None:
        return None if self._pushes is None else self._pushes.sender

    @property
    def tamper(self) -> TamperingTransport | None:
        """TEST ONLY: ``test_corrupt_push``."""
        return None if self._pushes is None else self._pushes.tamper

    # ---- setup ----------------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: Mapping[str, Any]) -> None:
        self._kv_caches = dict(kv_caches)  # registered memory must outlive us, whoever owns it
        self.memory = KVMemory.of(kv_caches, self.block_size)
        self.memory.register(self.transport)
        verify = digests_on(self.settings, self.transport, self.device, self.rank)
        log.info(
            "rank %d registered %d KV layers (%s) with %s",
            self.rank,
            len(self.memory.layer_names),
            self.memory.summary(),
            self.transport.session,
        )
        self._loads.attach(self.memory)
        if self.role in ("kv_consumer", "kv_both"):
            welcomer = Welcomer(
                self.engine_id,
                self.epoch,
                self.rank,
                self.tp_size,
                self.protocol,
                self.memory,
                self.transport,
            )
            welcomer.check_fits()
            if self.device.name != "npu":  # check whatever digests P ranks send
                self._loads.check_landed(self.device.checksums, self.settings.verify_kv)
            port = self.settings.side_channel_port + self.rank
            self.server = SideChannelServer(
                self.settings.side_channel_host or "0.0.0.0",
                port,
                welcomer.answer,
                self._loads.on_signal,
                self.tracker.on_alive,
                self.channel,
                self.tracker.on_digests,
            )
        if self.role in ("kv_producer", "kv_both"):
            self._pushes = self._push_side(self.memory, verify)

    def _push_side(self, memory: KVMemory, verify: bool) -> PushSide:
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
        return PushSide(
            s,
            self.transport,
            memory,
            options,
            SenderCallbacks(on_end=self._report_end, on_first_write=self._report_pushing),
            checksums=self.device.checksums,
            stats=self.stats,
            channel=self.channel,
            tracer=self.tracer,
        )

    # ---- per step -------------------------------------------------------------------------
    def _absorb(self, meta: PdgateMetadata) -> None:
        """Take in a step's metadata once (whichever hook sees it first)."""
        if meta is self._absorbed:
            return
        self._absorbed = meta
        self._loads.absorb(meta)
        if self._pushes is not None:
            self._pushes.absorb(meta)

    def handle_preemptions(self, meta: PdgateMetadata) -> None:
        """Before the forward may reuse a preempted request's blocks, let its pushes drain."""
        self._absorb(meta)
        if self._pushes is not None:
            self._pushes.handle_preemptions(meta)

    def start_step(self, meta: PdgateMetadata) -> None:
        self._absorb(meta)

    def save_layer(self, meta: PdgateMetadata, layer_name: str) -> None:
        self._absorb(meta)
        if self._pushes is not None:
            self._pushes.save_layer(meta, layer_name, self.device)

    def end_step(self, meta: PdgateMetadata) -> None:
        """After the step's last layer: queue the end of transfers whose prefill ended."""
        self._absorb(meta)
        if self._pushes is not None:
            self._pushes.end_step(meta)

    def transfer_results(self, finished_req_ids: set[str]) -> tuple[set[str], set[str], set[str]]:
        sending = set() if self._pushes is None else self._pushes.settled(finished_req_ids)
        self._loads.aborted(finished_req_ids)
        ended = self._loads.results(self.recompute)
        return sending, ended.finished, ended.failed

    def silent_loads(self) -> frozenset[str]:
        """Loads failed (this step) because P went silent (see ``RecvTracker.take_silent``)."""
        return frozenset(self.tracker.take_silent())

    def ready_loads(self) -> dict[str, float]:
        """Loads that ended intact since the last call, with when their KV was all there."""
        return self.tracker.take_ready()

    def blocks_of(self, req_ids: set[str]) -> set[int]:
        """The blocks the loads of ``req_ids`` were to fill, for loads the last
        ``transfer_results`` ended (vLLM before 0.32 learns of failed loads by block)."""
        return self._loads.blocks_of(req_ids)

    # ---- what P's pushes did, to the metaserver (the sender thread) ------------------------
    def _report_pushing(self, tr: Transfer) -> None:
        """A leg's first write landed: "pushing" once per request (its first leg to land)."""
        if self._events is not None and not any(leg.announced for leg in tr.legs if leg is not tr):
            detail = EventDetail(bytes_pushed=tr.bytes)
            self._events.post_event(tr.transfer_id, BindingState.PUSHING, self.actor, detail)

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
