"""vLLM's real ``Scheduler`` around the connector, on the tiny locally generated model."""

from __future__ import annotations

import inspect
import itertools
from pathlib import Path
from typing import Any

import torch
from vllm import SamplingParams
from vllm.config import (
    CacheConfig,
    DeviceConfig,
    KVTransferConfig,
    ModelConfig,
    SchedulerConfig,
    VllmConfig,
)
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput
from vllm.v1.request import Request, RequestStatus
from vllm.v1.structured_output import StructuredOutputManager

from connector.connector import PdgateConnector
from connector.metadata import PdgateMetadata, PdgateWorkerMetadata
from tests.support.sealing import sealed

BLOCK = 16
EOS = 2
_ids = itertools.count(1)
init_none_hash(sha256)


def vllm_config(
    model: Path,
    role: str,
    extra: dict[str, Any],
    *,
    batched_tokens: int = 64,
    policy: str = "recompute",
) -> VllmConfig:
    model_config = ModelConfig(model=str(model), dtype="float32", seed=0, max_model_len=4096)
    return VllmConfig(
        model_config=model_config,
        scheduler_config=SchedulerConfig(
            max_num_seqs=16,
            max_num_batched_tokens=batched_tokens,
            max_model_len=4096,
            enable_chunked_prefill=True,
            is_encoder_decoder=False,
        ),
        cache_config=CacheConfig(
            block_size=BLOCK, gpu_memory_utilization=0.9, enable_prefix_caching=True
        ),
        kv_transfer_config=KVTransferConfig(
            kv_connector="PdgateConnector",
            kv_connector_module_path="connector",
            kv_role=role,  # type: ignore[arg-type]
            kv_connector_extra_config=sealed(extra),  # the connector refuses an unsealed one
            kv_load_failure_policy=policy,  # type: ignore[arg-type]
        ),
        device_config=DeviceConfig("cpu"),
    )


def scheduler(config: VllmConfig, num_blocks: int = 200) -> Scheduler:
    kv_cache_config = KVCacheConfig(
        num_blocks=num_blocks,
        kv_cache_tensors=[],
        kv_cache_groups=[
            KVCacheGroupSpec(
                ["layer"],
                FullAttentionSpec(
                    block_size=BLOCK, num_kv_heads=1, head_size=1, dtype=torch.float32
                ),
            )
        ],
    )
    config.cache_config.num_gpu_blocks = num_blocks
    return Scheduler(
        vllm_config=config,
        kv_cache_config=kv_cache_config,
        structured_output_manager=StructuredOutputManager(config),
        block_size=BLOCK,
        log_stats=True,
    )


def connector_of(s: Scheduler) -> PdgateConnector:
    assert isinstance(s.connector, PdgateConnector)
    return s.connector


def request(tokens: list[int], params: dict[str, Any] | None, *, max_tokens: int = 4) -> Request:
    sp = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    sp.update_from_generation_config({}, EOS)
    req = Request(
        request_id=f"req-{next(_ids)}",
        prompt_token_ids=list(tokens),
        sampling_params=sp,
        pooling_params=None,
        block_hasher=get_request_block_hasher(BLOCK, sha256),
    )
    req.kv_transfer_params = params
    _PROMPT_LEN[req.request_id] = len(tokens)
    return req


def prompt(n: int, seed: int = 0) -> list[int]:
    return [3 + (i * 7 + seed * 13) % 900 for i in range(n)]


def meta(out: SchedulerOutput) -> PdgateMetadata:
    m = out.kv_connector_metadata
    assert isinstance(m, PdgateMetadata)
    return m


def runner_output(
    out: SchedulerOutput,
    *,
    sending: set[str] | None = None,
    recving: set[str] | None = None,
    failed: set[str] | None = None,
    silent: set[str] | None = None,
    ready: dict[str, float] | None = None,
    token: int = 7,
    s: Scheduler | None = None,
    stats: dict[str, Any] | None = None,
) -> ModelRunnerOutput:
    """What the workers report. A failed load goes out the way the running vLLM hears of it:
    ``failed_recving`` (0.32), or the blocks the load was to fill (before 0.32, as the
    connector's ``get_block_ids_with_load_errors``: those after D's own prefix hit).
    ``stats``: the workers' connector stats of this step (their merged delta dict); ``ready``:
    when the loads in ``recving`` had all their KV (wall clock)."""
    req_ids = list(out.num_scheduled_tokens)
    kv = None
    worker_meta = (
        PdgateWorkerMetadata(frozenset(silent or ()), ready or {}) if silent or ready else None
    )
    if sending or recving or failed or stats or silent:
        if "failed_recving" in KVConnectorOutput.__dataclass_fields__:
            kv = KVConnectorOutput(
                finished_sending=sending or None,
                finished_recving=recving or None,
                failed_recving=failed or set(),
                kv_connector_worker_meta=worker_meta,
            )
        else:
            assert s is not None or not failed
            invalid = {b for r in failed or () for b in _load_blocks(s, r)} if s else set()
            kv = KVConnectorOutput(
                finished_sending=sending or None,
                finished_recving=recving or None,
                invalid_block_ids=invalid,
                kv_connector_worker_meta=worker_meta,
            )
    if stats:
        from connector.prom import PdgateStats

        assert kv is not None
        kv.kv_connector_stats = PdgateStats(data=stats)
    return ModelRunnerOutput(
        req_ids=req_ids,
        req_id_to_index={r: i for i, r in enumerate(req_ids)},
        sampled_token_ids=[[] if _partial(out, r) else [token] for r in req_ids],
        logprobs=None,
        prompt_logprobs_dict={},
        pooler_output=None,
        kv_connector_output=kv,
    )


def _partial(out: SchedulerOutput, req_id: str) -> bool:
    """Whether this step computed only part of the request's prompt (no token sampled)."""
    for new in out.scheduled_new_reqs:
        if new.req_id == req_id:
            done = new.num_computed_tokens + out.num_scheduled_tokens[req_id]
            return done < len(new.prompt_token_ids or ())
    cached = out.scheduled_cached_reqs
    if req_id in cached.req_ids:
        i = cached.req_ids.index(req_id)
        done = cached.num_computed_tokens[i] + out.num_scheduled_tokens[req_id]
        return done < _PROMPT_LEN.get(req_id, 0)
    return False


_PROMPT_LEN: dict[str, int] = {}


# what the worker half keeps of each expected load (from the step's RecvEntry)
_LOADS: dict[str, list[int]] = {}


def _load_blocks(s: Scheduler, req_id: str) -> list[int]:
    return _LOADS.get(req_id, [])


def step(s: Scheduler, **kv: Any) -> tuple[SchedulerOutput, PdgateMetadata]:
    out = s.schedule()
    if isinstance(out.kv_connector_metadata, PdgateMetadata):
        for recv in out.kv_connector_metadata.recvs:
            _LOADS[recv.req_id] = recv.block_ids[recv.load_from :]
    for outputs in s.update_from_output(out, runner_output(out, s=s, **kv)).values():
        stats = outputs.scheduler_stats
        if stats is not None and stats.kv_connector_stats is not None:
            CONNECTOR_STATS.append(stats.kv_connector_stats)
        for o in outputs.outputs:
            if o.finish_reason is not None:
                FINISHED_PARAMS[o.request_id] = o.kv_transfer_params
    return out, meta(out)


# vLLM 0.24 and later ship the scheduler half's stats after every output; 0.23 only alongside
# the workers' (``if kv_connector_stats and self.connector`` in ``update_from_output``)
SCHEDULER_STATS_ALONE = "Scheduler-side KV connector stats" in inspect.getsource(
    Scheduler.update_from_output
)

# the connector stats vLLM's scheduler shipped (SchedulerStats.kv_connector_stats), in order
CONNECTOR_STATS: list[dict[str, Any]] = []


def connector_stats() -> dict[str, Any]:
    """Every delta shipped since the last call, merged (what the API process would add)."""
    from connector import stats

    merged: dict[str, Any] = {}
    for data in CONNECTOR_STATS:
        stats.merge(merged, data)
    CONNECTOR_STATS.clear()
    return merged


# request id -> the kv_transfer_params vLLM put in its final output (what the client's answer gets)
FINISHED_PARAMS: dict[str, dict[str, Any] | None] = {}


def block_ids(s: Scheduler, req_id: str) -> list[int]:
    return list(s.kv_cache_manager.get_block_ids(req_id)[0])


def free_blocks(s: Scheduler) -> int:
    return int(s.kv_cache_manager.block_pool.get_num_free_blocks())


def assert_empty(s: Scheduler) -> None:
    assert not s.requests
    assert len(s.waiting) == 0 and not s.running
    assert not s.finished_recving_kv_req_ids
    pool = s.kv_cache_manager.block_pool
    assert pool.get_num_free_blocks() == pool.num_gpu_blocks - 1
    assert all(b.ref_cnt == 0 for b in pool.blocks)


__all__ = ["RequestStatus"]
