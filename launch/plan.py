"""What to start: one ``Child`` per process, with its command line, environment and health URL."""

from __future__ import annotations

import ipaddress
import json
import os
import secrets
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from pdwire.compat import pairing_problem

Device = Literal["cpu", "cuda", "npu"]
# "pdgate": our PdgateConnector (D first: push flows). "nixl": vLLM's own NixlConnector, which
# pulls KV that P announces in its answer, so the proxy runs the prefill-first flow.
# "ascend": vllm-ascend's MooncakeLayerwiseConnector, unchanged (npu only): ascend-layerwise flow.
Connector = Literal["pdgate", "nixl", "ascend"]
PUSH_FLOWS = ("decode-first", "concurrent")  # need PdgateConnector (bindings in the metaserver)


@dataclass(frozen=True)
class DevicePreset:
    protocol: str
    flags: tuple[str, ...] = ()
    env: dict[str, str] = field(default_factory=dict)
    # the variable that gives each engine its own devices ("" = engines share the host)
    visible_devices_env: str = ""


# Per device: transfer-engine protocol and extra vLLM flags/environment.
_DEVICE = {
    "cpu": DevicePreset(
        "tcp",
        ("--gpu-memory-utilization", "0.1", "--dtype", "float32"),
        # the engines share the host's cores: unbound OpenMP threads, and none of them
        # spinning at a barrier while another engine (or the metaserver) needs the core; nor
        # in vLLM's queues between the engine core and its TP workers (connector/shm_wait.py)
        {
            "VLLM_CPU_KVCACHE_SPACE": "1",
            "VLLM_CPU_OMP_THREADS_BIND": "nobind",
            "OMP_WAIT_POLICY": "PASSIVE",
            "PDGATE_SHM_WAIT_S": "0.0002",
        },
    ),
    "cuda": DevicePreset("rdma", visible_devices_env="CUDA_VISIBLE_DEVICES"),
    "npu": DevicePreset("ascend", visible_devices_env="ASCEND_RT_VISIBLE_DEVICES"),
}

# vllm-cpu gives even a single-rank engine's model worker a process of its own ("mp" executor)
# unless VLLM_ENABLE_V1_MULTIPROCESSING=0 (vllm/platforms/cpu.py), and each process it starts
# imports vLLM and torch afresh ("spawn"). With the variable the worker runs inside the engine
# core's process ("uni" executor); the API server still runs the engine core apart. One engine
# alone here answered /health after 85 s against 131 s (docs/development.md).
CPU_SINGLE_PROCESS_WORKER = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}


def device_env(device: Device, first: int, count: int) -> dict[str, str]:
    """One engine's devices: ``count`` of them from index ``first`` of the visible list (the
    parent's ``CUDA_VISIBLE_DEVICES`` / ``ASCEND_RT_VISIBLE_DEVICES`` when set, else 0, 1, …)."""
    var = _DEVICE[device].visible_devices_env
    if not var:
        return {}
    visible = [d.strip() for d in os.environ.get(var, "").split(",") if d.strip()]
    if visible and first + count > len(visible):
        raise ValueError(f"{var}={','.join(visible)} has too few devices: need {first + count}")
    ids = (
        visible[first : first + count] if visible else [str(i) for i in range(first, first + count)]
    )
    return {var: ",".join(ids)}


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


def default_flow(connector: Connector) -> str:
    return {"nixl": "prefill-first", "ascend": "ascend-layerwise"}.get(connector, "decode-first")


def check_connector(o: LaunchOptions) -> None:
    if o.connector == "ascend":
        if o.device != "npu":
            raise ValueError("the ascend connector (MooncakeLayerwiseConnector) needs npu engines")
        if o.flow not in ("ascend-layerwise", "direct"):
            raise ValueError(f"flow {o.flow!r} does not drive vllm-ascend's layerwise connector")
        return
    if o.flow == "ascend-layerwise":
        raise ValueError("flow 'ascend-layerwise' needs --connector ascend")
    if o.connector != "nixl":
        if o.flow == "prefill-first":  # P would answer with nothing D's connector can pull
            raise ValueError(
                "flow 'prefill-first' needs a pull connector (--connector nixl); the pdgate "
                "connector pushes: use decode-first or concurrent"
            )
        return
    if o.device == "npu":
        raise ValueError("the nixl connector runs on cpu or cuda engines, not npu")
    if o.flow in PUSH_FLOWS:
        raise ValueError(
            f"flow {o.flow!r} needs the pdgate connector; with nixl use prefill-first (or direct)"
        )


def nixl_kv_transfer_config(o: LaunchOptions, role: str) -> str:
    """vLLM's NixlConnector: P keeps the prompt's blocks and answers where they are; D pulls
    them over UCX (host memory on cpu engines). A failed pull makes D recompute."""
    return json.dumps(
        {
            "kv_connector": "NixlConnector",
            "kv_role": role,
            "kv_buffer_device": "cpu" if o.device == "cpu" else "cuda",
            "kv_load_failure_policy": "recompute",
            "kv_connector_extra_config": {"backends": ["UCX"], **o.extra_connector_config},
        },
        separators=(",", ":"),
    )


def ascend_kv_transfer_config(o: LaunchOptions, role: str, kv_port: int) -> str:
    """vllm-ascend's layerwise config as its multi-node tutorial writes it
    (docs/source/tutorials/features/pd_disaggregation_mooncake_multi_node.md, "Layerwise"); D's
    side channel listens on ``kv_port`` + its TP rank."""
    return json.dumps(
        {
            "kv_connector": "MooncakeLayerwiseConnector",
            "kv_role": role,
            "kv_port": str(kv_port),
            "kv_connector_extra_config": {
                "prefill": {"dp_size": 1, "tp_size": o.tp_prefill},
                "decode": {"dp_size": 1, "tp_size": o.tp_decode},
                **o.extra_connector_config,
            },
        },
        separators=(",", ":"),
    )


def kv_transfer_config(
    o: LaunchOptions, role: str, instance_id: str, http_url: str, side_port: int
) -> str:
    if o.connector == "nixl":
        return nixl_kv_transfer_config(o, role)
    if o.connector == "ascend":
        return ascend_kv_transfer_config(o, role, side_port)
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
        **(
            {"side_channel_secret_file": o.side_channel_secret_file}
            if o.side_channel_secret_file
            else {}
        ),
        **o.extra_connector_config,
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


def kv_events_config(port: int, host: str = "0.0.0.0") -> str:
    """vLLM's ``--kv-events-config``: a publisher bound on ``host`` at ``port``, its replay
    socket at ``port + 1`` (what the connector registers, ``connector.kv_events``). The events
    carry prompt token ids: bound to the launch host, not every interface. vLLM binds its
    publisher only for an endpoint with ``*`` or ``::`` in it (it connects to any other), so an
    IPv4 host is named as its IPv4-mapped IPv6 address, which ZeroMQ binds as that IPv4
    address alone; ``0.0.0.0`` is every interface (``*``)."""
    if host in ("0.0.0.0", "*"):
        publisher, replay = f"tcp://*:{port}", f"tcp://*:{port + 1}"
    else:
        try:
            ip = ipaddress.ip_address(host)
        except ValueError:
            ip = None
        if not isinstance(ip, ipaddress.IPv4Address):
            raise ValueError(
                f"KV events are bound to the launch host, which must be an IPv4 address or "
                f"0.0.0.0 for that, not {host!r}"
            )
        publisher, replay = f"tcp://[::ffff:{ip}]:{port}", f"tcp://{ip}:{port + 1}"
    return json.dumps(
        {
            "enable_kv_cache_events": True,
            "publisher": "zmq",
            "endpoint": publisher,
            "replay_endpoint": replay,
            "topic": "kv",
        },
        separators=(",", ":"),
    )


def engine_child(
    o: LaunchOptions, role: str, index: int, port: int, side_port: int, events_port: int = 0
) -> Child:
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
    if events_port:
        argv += ["--kv-events-config", kv_events_config(events_port, o.host)]
    argv += list(o.extra_engine_args)
    env = dict(_DEVICE[o.device].env)
    if o.device == "cpu" and tp <= 1:
        env |= CPU_SINGLE_PROCESS_WORKER
    env |= o.extra_engine_env
    if o.connector == "nixl":  # NIXL's handshake listener (one port per engine)
        env |= {
            "VLLM_NIXL_SIDE_CHANNEL_HOST": o.host,
            "VLLM_NIXL_SIDE_CHANNEL_PORT": str(side_port),
        }
    if o.token and o.connector == "pdgate":
        env["PDGATE_METASERVER_TOKEN"] = o.token
    if o.engine_api_key:  # vLLM's --api-key, never on a command line
        env["VLLM_API_KEY"] = o.engine_api_key
    return Child(name, argv, url + "/health", env, kind="engine")


def kv_heads_of(model: str) -> tuple[int | None, bool]:
    """(total KV heads, MLA) from a local model directory's config.json (``None``: not known:
    a hub id, or a config that does not say)."""
    path = Path(model) / "config.json"
    try:
        config = json.loads(path.read_text())
    except (OSError, ValueError):
        return None, False
    config = config.get("text_config", config)  # multimodal models nest the language model's
    mla = bool(config.get("kv_lora_rank"))  # DeepSeek-style latent attention
    heads = config.get("num_key_value_heads", config.get("num_attention_heads"))
    return (int(heads) if isinstance(heads, int) else None), mla


def check_pairing(o: LaunchOptions) -> None:
    """Refuse TP sizes whose prefill KV cannot be pushed into decode's ranks (pdgate's
    connector; vllm-ascend's and NIXL's check their own)."""
    if o.connector != "pdgate" or o.flow not in PUSH_FLOWS:
        return
    heads, mla = kv_heads_of(o.model)
    problem = pairing_problem(o.tp_prefill, o.tp_decode, heads, mla)
    if problem is not None:
        raise ValueError(
            f"--tp-prefill {o.tp_prefill} with --tp-decode {o.tp_decode} cannot disaggregate: "
            f"{problem}"
        )


CREDENTIALS = "credentials.yaml"
ADMIN_TOKEN = "admin.token"
PROXY_ADMIN_KEY = "proxy-admin.key"  # the proxy's /admin and /v1/instances


def give_credentials(directory: Path, children: list[Child]) -> None:
    """Roles mode: a fresh token per engine (bound to its instance id and role), one for the
    proxy and one for an admin (``ADMIN_TOKEN``), the metaserver's credentials file listing
    them, and the proxy's admin key (``PROXY_ADMIN_KEY``); each part gets its own in its
    environment. Files are readable by this user only."""
    entries = []
    for child in children:
        token = secrets.token_urlsafe(24)
        if child.kind == "engine":
            role = "prefill" if child.name.startswith("prefill") else "decode"
            entries.append({"name": child.name, "role": "engine", "instance": child.name,
                            "engine_role": role, "token": token})  # fmt: skip
            child.env["PDGATE_METASERVER_TOKEN"] = token
        elif child.name == "proxy":
            entries.append({"name": "proxy", "role": "proxy", "token": token})
            child.env["PD_PROXY_METASERVER_TOKEN"] = token
            key = secrets.token_urlsafe(24)  # the operator's: drains, what the proxy sees
            child.env["PD_PROXY_ADMIN_KEYS"] = key
            write_private(directory / PROXY_ADMIN_KEY, key + "\n")
    admin = secrets.token_urlsafe(24)
    entries.append({"name": "admin", "role": "admin", "token": admin})
    write_private(directory / ADMIN_TOKEN, admin + "\n")
    write_private(directory / CREDENTIALS, json.dumps({"credentials": entries}, indent=1))  # YAML


def write_private(path: Path, text: str, *, new: bool = False) -> None:
    """Write ``text`` to a file only this user can read (``new``: refuse one that exists)."""
    flags = os.O_WRONLY | os.O_CREAT | (os.O_EXCL if new else os.O_TRUNC)
    with os.fdopen(os.open(path, flags, 0o600), "w") as f:
        f.write(text)


def check_sealing(o: LaunchOptions) -> None:
    """pdgate's connector refuses an unauthenticated side channel unless it is asked for by
    name (``insecure_side_channel``): say so before anything starts."""
    insecure = o.extra_connector_config.get("insecure_side_channel") is True
    if o.connector == "pdgate" and not o.side_channel_secret_file and not insecure:
        raise ValueError(
            "the pdgate connector needs a side-channel key file (--side-channel-secret-file; "
            "pd-launch makes a fresh one when it is not given)"
        )


def check_kv_events(o: LaunchOptions) -> None:
    if o.kv_routing and not o.kv_events_base_port:
        raise ValueError("--kv-routing needs the engines' KV events (--kv-events-base-port)")
    if o.kv_events_base_port and o.connector != "pdgate":
        raise ValueError("KV events are registered by pdgate's connector (--connector pdgate)")
    if o.kv_routing and not (Path(o.model) / "tokenizer_config.json").exists():
        raise ValueError("--kv-routing needs a local model directory (the proxy's tokenizer)")


def build_plan(o: LaunchOptions) -> LaunchPlan:
    check_connector(o)
    check_sealing(o)
    check_pairing(o)
    check_kv_events(o)
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
            + (
                ["--credentials-file", str(Path(o.credentials_dir) / CREDENTIALS)]
                if o.credentials_dir
                else []
            ),
            metaserver_url + "/ready",
            {"PD_METASERVER_TOKEN": o.token} if o.token else {},  # never in a process's argv
        )
    ]
    if o.kv_events_base_port:
        children[0].argv.append("--kv-events")
    events = o.kv_events_base_port
    port = o.engine_base_port
    side = o.side_channel_base_port
    pool: list[str] = []  # vllm-ascend: the decode engines' side channels
    prefill_urls: list[str] = []
    decode_urls: list[str] = []
    first_device = 0  # cuda / npu: each engine gets its own tp devices, prefill first
    for role, count, urls, tp in (
        ("kv_producer", o.prefill, prefill_urls, o.tp_prefill),
        ("kv_consumer", o.decode, decode_urls, o.tp_decode),
    ):
        for i in range(count):
            child = engine_child(o, role, i, port, side, events)
            events += 2 if events else 0
            child.env.update(device_env(o.device, first_device, max(tp, 1)))
            first_device += max(tp, 1)
            children.append(child)
            urls.append(child.health_url.removesuffix("/health"))
            if role == "kv_consumer":
                pool.append(f"{o.host}:{side}-{side + max(tp, 1) - 1}")
            port += 1
            side += max(tp, 1) + 1
    if o.connector == "ascend":  # the metaserver vets D's posted blocks against this pool
        children[0].argv.extend(["--ascend-decode", ",".join(pool)])
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
    if o.kv_routing:
        proxy_argv += ["--prefill-policy", "kv", "--decode-policy", "kv", "--tokenizer", o.model]
    proxy_argv += ["--flow-header", *o.extra_proxy_args]
    proxy_env = {"PD_PROXY_METASERVER_TOKEN": o.token} if o.token else {}
    if o.engine_api_key:
        proxy_env["PD_PROXY_ENGINE_API_KEY"] = o.engine_api_key
    children.append(Child("proxy", proxy_argv, proxy_url + "/health", proxy_env, kind="gate"))
    if o.credentials_dir:
        give_credentials(Path(o.credentials_dir), children)
    return LaunchPlan(o, children, proxy_url, metaserver_url, prefill_urls, decode_urls)
