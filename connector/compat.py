"""What the connector needs from vLLM, checked once before vLLM sees the class.

Supported (tested against vLLM's own ``Scheduler`` in the suite):

* vLLM 0.32–0.33 — every platform; caches arrive as ``[B, H, N, C]`` views;
* vLLM 0.23–0.25 — what vllm-ascend v0.23–v0.25 run on (caches arrive as vllm-ascend's K/V
  tuples; CUDA caches of these versions are 5-d and refused at ``register_kv_caches``).

The two generations differ in four places, detected by feature, not by version number:

* ``KVConnectorTransferResults`` / ``get_transfer_results`` (0.32) — older vLLM calls only
  ``get_finished``, which the connector implements on top of the same results;
* ``failed_recving`` (0.32) — older vLLM learns of a failed load from the block ids the
  worker returns from ``get_block_ids_with_load_errors``;
* ``bind_kv_cache_manager`` (0.32) — older vLLM never hands the scheduler half its block
  manager: the connector follows P's block ids from each ``SchedulerOutput`` instead;
* ``vllm.v1.kv_cache_layout`` (0.32) — older vLLM names layouts ``HND`` / ``NHD`` only.

A version outside these ranges is refused with one line naming it and what is missing
(``PDGATE_ALLOW_UNTESTED_VLLM=1`` turns that into a warning).
"""

from __future__ import annotations

import functools
import importlib.util
import logging
import os
import re
from dataclasses import dataclass, field
from typing import Any

from connector.errors import ConfigError

log = logging.getLogger("pdgate.connector.compat")

SUPPORTED = (((0, 23), (0, 25)), ((0, 32), (0, 33)))  # inclusive (major, minor) ranges
# the vLLM each vllm-ascend release line runs on (VLLM_TAG in vllm-ascend's Dockerfile at
# v0.23.0, v0.24.0rc1, v0.25.1rc1; docs/source/community/versioning_policy.md)
VLLM_OF_VLLM_ASCEND = {(0, 23): "0.23.0", (0, 24): "0.24.0", (0, 25): "0.25.1"}
ALLOW_ENV = "PDGATE_ALLOW_UNTESTED_VLLM"
# the KVConnectorBase_V1 methods both generations must have (the connector overrides them)
REQUIRED_METHODS = (
    "get_num_new_matched_tokens",
    "update_state_after_alloc",
    "build_connector_meta",
    "request_finished",
    "register_kv_caches",
    "start_load_kv",
    "wait_for_layer_load",
    "save_kv_layer",
    "wait_for_save",
    "get_finished",
    "get_finished_count",
    "handle_preemptions",
    "get_block_ids_with_load_errors",
)


def supported_text() -> str:
    return ", ".join(f"{a[0]}.{a[1]}-{b[0]}.{b[1]}" for a, b in SUPPORTED)


def version_of(text: str) -> tuple[int, int] | None:
    m = re.match(r"(\d+)\.(\d+)", text)
    return (int(m.group(1)), int(m.group(2))) if m else None


def in_range(version: tuple[int, int] | None) -> bool:
    return version is not None and any(lo <= version <= hi for lo, hi in SUPPORTED)


def check() -> str:
    """The running vLLM's version, or ``ConfigError`` (one line) when the connector cannot
    run on it."""
    try:
        import vllm
        from vllm.distributed.kv_transfer.kv_connector.v1 import base
    except ImportError as exc:
        raise ConfigError(f"PdgateConnector needs vLLM ({supported_text()}): {exc}") from None
    version = str(getattr(vllm, "__version__", "unknown"))
    missing = [m for m in REQUIRED_METHODS if not hasattr(base.KVConnectorBase_V1, m)]
    if missing:
        raise ConfigError(
            f"PdgateConnector cannot run on vLLM {version}: KVConnectorBase_V1 has no "
            f"{', '.join(missing)} (supported: vLLM {supported_text()})"
        )
    if not in_range(version_of(version)):
        text = (
            f"PdgateConnector is tested on vLLM {supported_text()}, not {version} "
            f"(set {ALLOW_ENV}=1 to run it anyway)"
        )
        if os.environ.get(ALLOW_ENV) != "1":
            raise ConfigError(text)
        log.warning("%s; running because %s=1", text, ALLOW_ENV)
    return version


@dataclass(frozen=True, slots=True)
class Features:
    transfer_results: bool  # KVConnectorTransferResults, failed_recving, get_transfer_results
    bind_manager: bool  # KVConnectorBase_V1.bind_kv_cache_manager
    layout_enum: bool  # vllm.v1.kv_cache_layout.KVCacheLayout


@functools.cache
def features() -> Features:
    from vllm.distributed.kv_transfer.kv_connector.v1 import base

    return Features(
        transfer_results=hasattr(base, "KVConnectorTransferResults"),
        bind_manager=hasattr(base.KVConnectorBase_V1, "bind_kv_cache_manager"),
        layout_enum=importlib.util.find_spec("vllm.v1.kv_cache_layout") is not None,
    )


try:
    from vllm.distributed.kv_transfer.kv_connector.v1.base import (
        KVConnectorTransferResults as KVConnectorTransferResults,
    )
except ImportError:

    @dataclass
    class KVConnectorTransferResults:  # type: ignore[no-redef]
        """vLLM 0.32's result type, for the older vLLM that lacks it."""

        finished_sending: set[str] = field(default_factory=set)
        finished_recving: set[str] = field(default_factory=set)
        failed_recving: set[str] = field(default_factory=set)


def legacy_layout_name(name: str) -> str | None:
    """What vLLM before ``KVCacheLayout`` calls a layout (``HND`` / ``NHD``), if anything."""
    return {"LBHNC": "HND", "LBNHC": "NHD"}.get(name)


def refuse_unsupported(vllm_config: Any) -> None:
    """Engine options whose KV the connector would move wrongly, refused at start (both
    roles, before anything is registered)."""
    extra = getattr(vllm_config, "additional_config", None)
    if isinstance(extra, dict) and extra.get("enable_kv_nz"):
        raise ConfigError(
            "vllm-ascend's additional_config enable_kv_nz keeps D's blocks in NZ order, but P "
            "pushes its KV in ND order: turn enable_kv_nz off for pdgate"
        )
    par = getattr(vllm_config, "parallel_config", None)
    size = int(getattr(par, "data_parallel_size", 1) or 1)
    index = int(getattr(par, "data_parallel_index", getattr(par, "data_parallel_rank", 0)) or 0)
    if size > 1 or index > 0:
        raise ConfigError(
            f"data parallelism (data_parallel_size {size}, this engine's index {index}) is not "
            "supported by PdgateConnector: its DP ranks would share one instance id and one "
            "side-channel port range; run one vLLM server per DP rank, each with its own "
            "instance_id and side_channel_port"
        )
