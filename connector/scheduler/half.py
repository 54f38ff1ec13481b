"""The scheduler half: routes vLLM's scheduler calls to the decode and/or prefill side."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any
from urllib.parse import urlparse

from connector import fingerprint
from connector.config import ConnectorSettings
from connector.errors import ConfigError
from connector.kv_events import kv_events_of
from connector.metadata import PdgateMetadata, PdgateWorkerMetadata, skew_margin
from connector.scheduler.decode import DecodeSide, Identity
from connector.scheduler.lookups import Lookups
from connector.scheduler.prefill import PrefillSide
from connector.scheduler.ready import ReadyWait
from connector.scheduler.registrar import Registrar
from connector.stats import StatsCollector
from connector.tracing import build_tracer
from connector.transport.mooncake import late_landing_s
from pdwire.client import AsyncMetaserverClient, BackgroundWriter, MetaserverClient
from pdwire.models import InstanceRole, InstanceSpec, KVEndpoint, KVIdentity
from pdwire.version import PROTOCOL_VERSION

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks, KVCacheManager
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

log = logging.getLogger("pdgate.connector.scheduler")

_ROLES = {
    "kv_producer": InstanceRole.PREFILL,
    "kv_consumer": InstanceRole.DECODE,
    "kv_both": InstanceRole.BOTH,
}


def identity_of(vllm_config: VllmConfig, settings: ConnectorSettings) -> Identity:
    kv = vllm_config.kv_transfer_config
    assert kv is not None
    model = vllm_config.model_config
    http_port = urlparse(settings.http_url).port if settings.http_url else None
    return Identity(
        instance_id=settings.resolved_instance_id(http_port),
        engine_id=str(kv.engine_id),
        kv_endpoint=KVEndpoint(host=settings.resolved_host(), port=settings.side_channel_port),
        tp_size=vllm_config.parallel_config.tensor_parallel_size,
        num_kv_heads=model.get_total_num_kv_heads() if model is not None else None,
        use_mla=bool(getattr(model, "use_mla", False)),
        block_size=vllm_config.cache_config.block_size,
    )


def kv_identity_of(vllm_config: VllmConfig) -> KVIdentity | None:
    """What P and D must share for P's KV to be D's (``None``: no model config)."""
    model = vllm_config.model_config
    if model is None:
        return None
    cache = vllm_config.cache_config
    dtype = str(model.dtype).removeprefix("torch.")
    kv_dtype = str(cache.cache_dtype)
    return KVIdentity(
        model=fingerprint.of_model(str(model.model), getattr(model, "hf_config", None)),
        dtype=dtype,
        kv_cache_dtype=dtype if kv_dtype == "auto" else kv_dtype,
        block_size=cache.block_size,
        head_size=model.get_head_size(),
        num_kv_heads=model.get_total_num_kv_heads(),
        num_layers=model.get_num_layers(vllm_config.parallel_config),
        use_mla=bool(getattr(model, "use_mla", False)),
        protocol=PROTOCOL_VERSION,
    )


def push_window(kv_load_timeout_s: float) -> float:
    """How long after its binding was created P may still write into D's blocks when the
    binding does not state D's deadline (a D before ``load_deadline``): P's own
    ``kv_load_timeout_s`` (which must then equal D's) minus a margin for clock skew and writes in
    flight."""
    return kv_load_timeout_s - skew_margin(kv_load_timeout_s)


class ConnectorScheduler:
    def __init__(
        self,
        vllm_config: VllmConfig,
        settings: ConnectorSettings,
        *,
        sync_client: Callable[[], MetaserverClient] | None = None,
        async_client: Callable[[], AsyncMetaserverClient] | None = None,
    ) -> None:
        if not settings.metaserver_url:
            raise ConfigError("kv_connector_extra_config.metaserver_url is required")
        kv = vllm_config.kv_transfer_config
        assert kv is not None and kv.kv_role is not None
        self.settings = settings
        self.stats = StatsCollector()
        self._p_held: dict[str, int] = {}  # P: req id -> blocks kept until its pushes end
        self.me = identity_of(vllm_config, settings)
        url, token = settings.metaserver_url, settings.token
        make_sync = sync_client or (lambda: MetaserverClient(url, token=token))
        make_async = async_client or (lambda: AsyncMetaserverClient(url, token=token))
        self.world_size = vllm_config.parallel_config.world_size
        self.writer = BackgroundWriter(make_sync())
        self.lookups = Lookups(
            make_async,
            binding_wait_s=settings.binding_wait_s,
            instance_ttl_s=max(settings.heartbeat_s, 1.0),
        )
        role = _ROLES[kv.kv_role]
        spec = InstanceSpec(
            role=role,
            url=settings.http_url or f"http://{settings.resolved_host()}:8000",
            kv_endpoint=self.me.kv_endpoint,
            model=vllm_config.model_config.model if vllm_config.model_config else None,
            tp_size=self.me.tp_size,
            ttl_s=max(3 * settings.heartbeat_s, 1.0),
            revision=settings.revision or None,
            kv=kv_identity_of(vllm_config),
            kv_events=kv_events_of(vllm_config),
        )
        self.registrar = Registrar(make_sync(), self.me.instance_id, spec, settings.heartbeat_s)
        self.registrar.start()
        resource = {"pdgate.instance_id": self.me.instance_id, "pdgate.role": role.value}
        self.tracer = build_tracer(settings.otlp_traces_endpoint, resource)
        self.decode = (
            DecodeSide(
                self.writer,
                self.me,
                settings.kv_load_timeout_s,
                tracer=self.tracer,
                stats=self.stats,
                # the deadlines the connector gives Mooncake (set_deadlines): both write_timeout_s
                late_landing_s=late_landing_s(settings.write_timeout_s, settings.write_timeout_s),
            )
            if role is not InstanceRole.PREFILL
            else None
        )
        self.ready = ReadyWait(self.stats) if self.decode is not None else None
        self.prefill = (
            PrefillSide(
                self.lookups,
                self.me.block_size,
                concurrent=settings.concurrent,
                events=self.writer,
                actor=self.me.instance_id,
                push_window_s=push_window(settings.kv_load_timeout_s),
                registry_grace_s=settings.registry_grace_s,
                tp_size=self.me.tp_size,
                tracer=self.tracer,
                spec=spec,
                stats=self.stats,
            )
            if role is not InstanceRole.DECODE
            else None
        )
        log.info("pdgate connector scheduler: %s as %s", self.me, role.value)

    def bind(self, manager: KVCacheManager) -> None:
        if self.prefill is not None:
            self.prefill.bind(manager)
        if self.decode is not None:
            self.decode.bind(manager)

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        if self.decode is not None:
            count, is_async = self.decode.matched(request, num_computed_tokens)
            if count:
                return count, is_async
        if self.prefill is not None:
            return self.prefill.matched(request, num_computed_tokens)
        return 0, False

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        if self.decode is not None:
            self.decode.after_alloc(request, blocks, num_external_tokens)
        if self.prefill is not None:
            self.prefill.after_alloc(request)

    def build_connector_meta(self, out: SchedulerOutput) -> PdgateMetadata:
        meta = PdgateMetadata()
        if self.decode is not None:
            self.decode.fill(meta)
        if self.ready:  # loads ended intact, their requests not yet scheduled
            self.ready.scheduled(r.req_id for r in out.scheduled_new_reqs)
        if self.prefill is not None:
            self.prefill.fill(meta, out)
        return meta

    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        if self.decode is not None:
            self.decode.finished(request)
        if self.ready is not None:
            self.ready.forget(request.request_id)
        if self.prefill is None:
            return False, None
        delay_free, report = self.prefill.finished(request)
        if delay_free and block_ids:
            self._p_held[request.request_id] = len(block_ids)
            self.stats.add("blocks_held", len(block_ids), label="prefill")
        return delay_free, report

    def update_connector_output(self, out: KVConnectorOutput) -> None:
        """The workers' finished transfers of this step: blocks no longer held for them; and
        loads failed for P's silence, whose blocks are quarantined before vLLM frees (or
        recomputes into) them, later in this same step."""
        meta = out.kv_connector_worker_meta
        if isinstance(meta, PdgateWorkerMetadata):
            if self.decode is not None and meta.silent:
                self.decode.quarantine(meta.silent)
            if self.ready is not None and meta.ready:
                self.ready.ready(meta.ready)
        if self.decode is not None and out.finished_recving:
            self.decode.loaded(out.finished_recving)
        for req_id in out.finished_sending or ():
            held = self._p_held.pop(req_id, 0)
            if held:
                self.stats.add("blocks_held", -held, label="prefill")

    def has_pending_work(self) -> bool:
        """vLLM must keep stepping an engine with no request left while blocks a silent P may
        still write are quarantined (the quarantine ends, and the blocks go back, only at a
        step), and while P has leases to close (``LeaseCloser``): an idle vLLM takes no step."""
        if self.decode is not None and self.decode.quarantined_blocks > 0:
            return True
        return self.prefill is not None and self.prefill.leases.pending

    def get_finished_count(self) -> int:
        # Every worker rank reports each finished id exactly once (replica ranks that push
        # nothing included), so vLLM's aggregator waits for all ranks of this instance.
        return int(self.world_size)

    def shutdown(self) -> None:
        self.registrar.close()
        self.lookups.close()
        self.writer.close()
        if self.tracer is not None:
            self.tracer.shutdown()
