"""What to start: one ``Child`` per process, with its command line, environment and health URL."""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

Device = Literal["cpu", "cuda", "npu"]


@dataclass(frozen=True)
class DevicePreset:
    protocol: str
    flags: tuple[str, ...] = ()
    env: dict[str, str] = field(default_factory=dict)


# Per device: transfer-engine protocol and extra vLLM flags/environment.
_DEVICE = {
    "cpu": DevicePreset(
        "tcp",
        ("--gpu-memory-utilization", "0.1", "--dtype", "float32"),
        {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": "nobind"},
    ),
    "cuda": DevicePreset("rdma"),
    "npu": DevicePreset("ascend"),
}


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
    token: str | None = None
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


@dataclass(frozen=True)
class LaunchPlan:
    options: LaunchOptions
    children: list[Child]
    proxy_url: str
    metaserver_url: str
    prefill_urls: list[str]
    decode_urls: list[str]


def kv_transfer_config(
    o: LaunchOptions, role: str, instance_id: str, http_url: str, side_port: int
) -> str:
    extra = {
        "metaserver_url": f"http://{o.host}:{o.metaserver_port}",
        "instance_id": instance_id,
        "http_url": http_url,
        "side_channel_host": o.host,
        "side_channel_port": side_port,
        "transport": o.transport,
        "mooncake_protocol": _DEVICE[o.device].protocol,
        "device": o.device,
        "kv_load_timeout_s": o.kv_load_timeout_s,
        "heartbeat_s": 2.0,
        "concurrent": True,  # P can fetch bindings itself: the proxy may pick the flow per request
    }
    return json.dumps(
        {
            "kv_connector": "PdgateConnector",
            "kv_connector_module_path": "connector",
            "kv_role": role,
            "kv_load_failure_policy": "recompute",
            "kv_connector_extra_config": extra,
        },
        separators=(",", ":"),
    )


def engine_child(o: LaunchOptions, role: str, index: int, port: int, side_port: int) -> Child:
    name = f"{'prefill' if role == 'kv_producer' else 'decode'}-{index}"
    url = f"http://{o.host}:{port}"
    tp = o.tp_prefill if role == "kv_producer" else o.tp_decode
    argv = [
        sys.executable,
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        o.model,
        "--host",
        o.host,
        "--port",
        str(port),
        "--served-model-name",
        Path(o.model).name if Path(o.model).exists() else o.model,
        "--max-model-len",
        str(o.max_model_len),
        "--tensor-parallel-size",
        str(tp),
        "--kv-transfer-config",
        kv_transfer_config(o, role, name, url, side_port),
        *_DEVICE[o.device].flags,
    ]
    if o.max_num_batched_tokens:
        argv += ["--max-num-batched-tokens", str(o.max_num_batched_tokens)]
    if o.block_size:
        argv += ["--block-size", str(o.block_size)]
    argv += list(o.extra_engine_args)
    env = dict(_DEVICE[o.device].env)
    if o.token:
        env["PDGATE_METASERVER_TOKEN"] = o.token
    return Child(name, argv, url + "/health", env, kind="engine")


def build_plan(o: LaunchOptions) -> LaunchPlan:
    bin_dir = Path(sys.executable).parent
    metaserver_url = f"http://{o.host}:{o.metaserver_port}"
    children = [
        Child(
            "metaserver",
            [
                str(bin_dir / "pd-metaserver"),
                "--host",
                o.host,
                "--port",
                str(o.metaserver_port),
                "--store",
                o.redis_url or "memory",
            ]
            + (["--token", o.token] if o.token else []),
            metaserver_url + "/ready",
        )
    ]
    port = o.engine_base_port
    side = o.side_channel_base_port
    prefill_urls: list[str] = []
    decode_urls: list[str] = []
    for role, count, urls, tp in (
        ("kv_producer", o.prefill, prefill_urls, o.tp_prefill),
        ("kv_consumer", o.decode, decode_urls, o.tp_decode),
    ):
        for i in range(count):
            child = engine_child(o, role, i, port, side)
            children.append(child)
            urls.append(child.health_url.removesuffix("/health"))
            port += 1
            side += max(tp, 1) + 1
    proxy_url = f"http://{o.host}:{o.proxy_port}"
    proxy_argv = [
        str(bin_dir / "pd-proxy"),
        "--host",
        o.host,
        "--port",
        str(o.proxy_port),
        "--metaserver",
        metaserver_url,
        "--flow",
        o.flow,
    ]
    for url in prefill_urls:
        proxy_argv += ["--prefill", url]
    for url in decode_urls:
        proxy_argv += ["--decode", url]
    proxy_argv += ["--flow-header", *o.extra_proxy_args]
    proxy_env = {"PD_PROXY_METASERVER_TOKEN": o.token} if o.token else {}
    children.append(Child("proxy", proxy_argv, proxy_url + "/health", proxy_env, kind="gate"))
    return LaunchPlan(o, children, proxy_url, metaserver_url, prefill_urls, decode_urls)
