"""``PdgateConnector``: the ``KVConnectorBase_V1`` facade vLLM builds twice.

With ``role=SCHEDULER`` (EngineCore) it holds a ``ConnectorScheduler``; with ``role=WORKER``
(each TP rank) a ``ConnectorWorker``. Every API call is forwarded to the half that exists.
On vLLM before 0.32 (``connector/compat.py``) the facade also follows P's block ids from the
scheduler output, reports failed loads by block, and ends transfers from ``get_finished`` on
steps without a forward (where that vLLM skips ``wait_for_save``).
"""

from __future__ import annotations

import logging
import os
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorWorkerMetadata,
)

from connector.compat import (
    KVConnectorTransferResults,
    features,
    legacy_layout_name,
    refuse_unsupported,
)
from connector.config import load_settings
from connector.metadata import PdgateMetadata, PdgateWorkerMetadata
from connector.scheduler.blocks import BlockTracker
from connector.shm_wait import install as install_shm_wait

if TYPE_CHECKING:
    import torch
    from vllm.config import VllmConfig
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
        KVConnectorPromMetrics,
        KVConnectorStats,
    )
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks, KVCacheManager
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

    from connector.scheduler import ConnectorScheduler
    from connector.worker import ConnectorWorker


def _share_vllm_logging() -> None:
    """Inside vLLM only its own logger has handlers: route ``pdgate.*`` records there too."""
    ours, theirs = logging.getLogger("pdgate"), logging.getLogger("vllm")
    if not ours.handlers and not logging.getLogger().handlers and theirs.handlers:
        for handler in theirs.handlers:
            ours.addHandler(handler)
        ours.setLevel(os.environ.get("PDGATE_LOG_LEVEL", "INFO").upper())
        ours.propagate = False


class PdgateConnector(KVConnectorBase_V1):
    def __init__(
        self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig
    ) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        _share_vllm_logging()
        install_shm_wait()  # PDGATE_SHM_WAIT_S: the queues to the TP workers sleep, not spin
        kv = vllm_config.kv_transfer_config
        assert kv is not None
        refuse_unsupported(vllm_config)
        self.settings = load_settings(kv.kv_connector_extra_config)
        self.scheduler: ConnectorScheduler | None = None
        self.worker: ConnectorWorker | None = None
        self._legacy = not features().transfer_results  # vLLM before 0.32
        self._blocks: BlockTracker | None = None
        self._load_errors: set[int] = set()
        if role == KVConnectorRole.SCHEDULER:
            from connector.scheduler import ConnectorScheduler

            self.scheduler = ConnectorScheduler(vllm_config, self.settings)
            if not features().bind_manager:
                self._blocks = BlockTracker()
                self.scheduler.bind(self._blocks)  # type: ignore[arg-type]
        else:
            from connector.worker import ConnectorWorker

            self.worker = ConnectorWorker(vllm_config, self.settings)

    @classmethod
    def get_required_kvcache_layout(cls, vllm_config: VllmConfig) -> str | None:
        """The layout vLLM should give both engines (``kv_cache_layout``; default head-major
        ``LBHNC``): any layout is placed exactly, but token-major pages cost one write per
        token for a heterogeneous-TP slice of heads (measured on an H100: docs/benchmarks.md).
        MLA has one head, so the backend chooses."""
        kv = vllm_config.kv_transfer_config
        wanted = load_settings(kv.kv_connector_extra_config if kv else None).kv_cache_layout
        model = vllm_config.model_config
        if wanted == "backend" or (model is not None and model.use_mla):
            return None
        return wanted if features().layout_enum else legacy_layout_name(wanted)

    # ---- scheduler side -------------------------------------------------------------------
    def bind_kv_cache_manager(self, kv_cache_manager: KVCacheManager) -> None:
        super().bind_kv_cache_manager(kv_cache_manager)
        if self.scheduler is not None:
            self.scheduler.bind(kv_cache_manager)

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        assert self.scheduler is not None
        return self.scheduler.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        assert self.scheduler is not None
        self.scheduler.update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        assert self.scheduler is not None
        if self._blocks is not None:
            self._blocks.update(scheduler_output)
        return self.scheduler.build_connector_meta(scheduler_output)

    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        assert self.scheduler is not None
        return self.scheduler.request_finished(request, block_ids)

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        if self.scheduler is not None:
            self.scheduler.update_connector_output(connector_output)

    def has_pending_push_work(self) -> bool:
        # vLLM (0.24+) keeps stepping the engine while this is true, requests or not. vLLM
        # names it for push transfers; here it is D's quarantined blocks, which go back only
        # at a step once their hold ends, and P's leases still to close.
        return self.scheduler is not None and self.scheduler.has_pending_work()

    def get_finished_count(self) -> int | None:
        return self.scheduler.get_finished_count() if self.scheduler is not None else None

    # ---- worker side ----------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        assert self.worker is not None
        self.worker.register_kv_caches(kv_caches)

    def handle_preemptions(self, kv_connector_metadata: KVConnectorMetadata) -> None:
        if self.worker is not None and isinstance(kv_connector_metadata, PdgateMetadata):
            self.worker.handle_preemptions(kv_connector_metadata)

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        assert self.worker is not None
        meta = self._get_connector_metadata()
        assert isinstance(meta, PdgateMetadata)
        self.worker.start_step(meta)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return None  # loads are asynchronous: KV arrives before the request is scheduled

    def save_kv_layer(
        self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any
    ) -> None:
        assert self.worker is not None
        meta = self._get_connector_metadata()
        assert isinstance(meta, PdgateMetadata)
        self.worker.save_layer(meta, layer_name)

    def wait_for_save(self) -> None:
        if self.worker is not None and self.has_connector_metadata():
            meta = self._get_connector_metadata()
            assert isinstance(meta, PdgateMetadata)
            self.worker.end_step(meta)

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        assert self.worker is not None
        sending, recving, failed = self.worker.transfer_results(finished_req_ids)
        return KVConnectorTransferResults(
            finished_sending=sending, finished_recving=recving, failed_recving=failed
        )

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        """What vLLM before 0.32 calls instead of ``get_transfer_results``."""
        if self.worker is not None and self.has_connector_metadata():
            meta = self._get_connector_metadata()
            if isinstance(meta, PdgateMetadata):  # that vLLM skips wait_for_save without a forward
                self.worker.end_step(meta)
        res = self.get_transfer_results(finished_req_ids)
        if self._legacy and res.failed_recving and self.worker is not None:
            self._load_errors |= self.worker.blocks_of(res.failed_recving)
        return res.finished_sending or None, res.finished_recving or None

    def build_connector_worker_meta(self) -> KVConnectorWorkerMetadata | None:
        if self.worker is None:
            return None
        silent, ready = self.worker.silent_loads(), self.worker.ready_loads()
        return PdgateWorkerMetadata(silent, ready) if silent or ready else None

    def get_block_ids_with_load_errors(self) -> set[int]:
        """vLLM before 0.32: the blocks of loads that failed (it recomputes from the first);
        later vLLM hears of them through ``failed_recving``."""
        errors, self._load_errors = self._load_errors, set()
        return errors

    # ---- metrics (connector/stats.py, connector/prom.py) -----------------------------------
    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        """This half's deltas since the last call (vLLM calls it after every step on each
        worker, and on the scheduler after each output), or ``None`` when there are none."""
        half = self.scheduler if self.scheduler is not None else self.worker
        data = half.stats.take() if half is not None else None
        if data is None:
            return None
        from connector.prom import PdgateStats

        return PdgateStats(data=data)

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KVConnectorStats:
        from connector.prom import PdgateStats

        return PdgateStats(data=dict(data) if data else {})

    @classmethod
    def build_prom_metrics(
        cls,
        vllm_config: VllmConfig,
        metric_types: dict[type[Any], type[Any]],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> KVConnectorPromMetrics:
        from connector.prom import PdgatePromMetrics

        return PdgatePromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    def shutdown(self) -> None:
        if self.scheduler is not None:
            self.scheduler.shutdown()
        if self.worker is not None:
            self.worker.shutdown()
