"""What pd-launch is asked for (``LaunchOptions``) and what it will start (``LaunchPlan``: one
``Child`` per process, with its command line, environment and health URL)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

Device = Literal["cpu", "cuda", "npu"]
# "pdgate": our PdgateConnector (D first: push flows). "nixl": vLLM's own NixlConnector, which
# pulls KV that P announces in its answer, so the proxy runs the prefill-first flow.
# "ascend": vllm-ascend's MooncakeLayerwiseConnector, unchanged (npu only): ascend-layerwise flow.
Connector = Literal["pdgate", "nixl", "ascend"]
PUSH_FLOWS = ("decode-first", "concurrent")  # need PdgateConnector (bindings in the metaserver)


@dataclass(frozen=True)
class Child:
    name: str
    argv: list[str]
    health_url: str
    env: dict[str, str] = field(default_factory=dict)
    # "service"; "engine" (slow to load); "gate": healthy only once it sees the others (proxy)
    kind: str = "service"


@dataclass(frozen=True)
class LaunchOptions:
    model: str
    prefill: int = 1
    decode: int = 1
    device: Device = "cpu"
    host: str = "127.0.0.1"
    proxy_port: int = 8000
    metaserver_port: int = 8300
    engine_base_port: int = 8100
    side_channel_base_port: int = 5600
    redis_url: str | None = None
    token: str | None = None  # the metaserver's single token (every part holds it)
    # roles mode instead: a private directory where the plan writes the metaserver's
    # credentials file (one engine credential per instance, a proxy's, an admin's)
    credentials_dir: str = ""
    # pdgate connector: the side channel's key file (required, unless extra_connector_config
    # asks for ``insecure_side_channel``)
    side_channel_secret_file: str = ""
    flow: str = "decode-first"
    max_model_len: int = 2048
    max_num_batched_tokens: int | None = None
    block_size: int | None = None
    tp_prefill: int = 1
    tp_decode: int = 1
    kv_load_timeout_s: float = 60.0
    extra_engine_args: tuple[str, ...] = ()
    extra_proxy_args: tuple[str, ...] = ()
    transport: str = "mooncake"
    # merged last into every engine's kv_connector_extra_config (tests: e.g. verify_kv)
    extra_connector_config: dict[str, object] = field(default_factory=dict)
    extra_engine_env: dict[str, str] = field(default_factory=dict)
    connector: Connector = "pdgate"
    # KV cache events: each engine publishes on base + 2i (replay: + 1), the metaserver follows
    # them into its index (0: off); ``kv_routing`` also has the proxy route on it (kv policy)
    kv_events_base_port: int = 0
    kv_routing: bool = False
    # engines serve only callers with this key (vLLM's VLLM_API_KEY; the proxy's
    # PD_PROXY_ENGINE_API_KEY): '' = engines answer anyone
    engine_api_key: str = ""


@dataclass(frozen=True)
class LaunchPlan:
    options: LaunchOptions
    children: list[Child]
    proxy_url: str
    metaserver_url: str
    prefill_urls: list[str]
    decode_urls: list[str]
