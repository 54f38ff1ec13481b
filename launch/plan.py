"""How to start what ``LaunchOptions`` asks for: each engine's, the metaserver's and the proxy's
command line and environment, checked before anything starts (``build_plan``)."""

from __future__ import annotations

import ipaddress
import json
import sys
from pathlib import Path

from launch.credentials import CREDENTIALS, give_credentials
from launch.devices import CPU_SINGLE_PROCESS_WORKER, DEVICES, device_env
from launch.options import PUSH_FLOWS, Child, Connector, LaunchOptions, LaunchPlan
from pdwire.compat import pairing_problem


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
        "mooncake_protocol": DEVICES[o.device].protocol,
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
        *DEVICES[o.device].flags,
    ]
    if o.max_num_batched_tokens:
        argv += ["--max-num-batched-tokens", str(o.max_num_batched_tokens)]
    if o.block_size:
        argv += ["--block-size", str(o.block_size)]
    if events_port:
        argv += ["--kv-events-config", kv_events_config(events_port, o.host)]
    argv += list(o.extra_engine_args)
    env = dict(DEVICES[o.device].env)
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
