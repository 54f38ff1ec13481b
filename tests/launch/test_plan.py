"""pd-launch's plan: ports, roles and the connector configuration every engine gets."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from launch.credentials import ADMIN_TOKEN
from launch.options import LaunchOptions
from launch.plan import build_plan
from metaserver.access import Access, Role
from tests.launch.options import KEY_FILE, options
from tests.support.access import resolved


def kv_config(argv: list[str]) -> dict[str, object]:
    return dict(json.loads(argv[argv.index("--kv-transfer-config") + 1]))


def test_plan_wires_roles_ports_and_metaserver() -> None:
    plan = build_plan(options(model="/m/tiny", prefill=2, decode=2, token="tok"))
    names = [c.name for c in plan.children]
    assert names == ["metaserver", "prefill-0", "prefill-1", "decode-0", "decode-1", "proxy"]
    engines = [c for c in plan.children if c.kind == "engine"]
    ports = [c.argv[c.argv.index("--port") + 1] for c in engines]
    assert len(set(ports)) == 4
    sides = []
    for child in engines:
        cfg = kv_config(child.argv)
        extra = cfg["kv_connector_extra_config"]
        assert isinstance(extra, dict)
        assert (
            cfg["kv_connector"] == "PdgateConnector"
            and cfg["kv_connector_module_path"] == "connector"
        )
        assert cfg["kv_role"] == (
            "kv_producer" if child.name.startswith("prefill") else "kv_consumer"
        )
        assert extra["metaserver_url"] == plan.metaserver_url
        assert extra["instance_id"] == child.name
        assert extra["http_url"] == child.health_url.removesuffix("/health")
        assert extra["mooncake_protocol"] == "tcp" and extra["device"] == "cpu"
        assert child.env["PDGATE_METASERVER_TOKEN"] == "tok"
        assert "tok" not in " ".join(child.argv)  # the token never appears on a command line
        sides.append(extra["side_channel_port"])
    assert len(set(sides)) == 4
    proxy = plan.children[-1]
    assert proxy.argv.count("--prefill") == 2 and proxy.argv.count("--decode") == 2
    assert proxy.env["PD_PROXY_METASERVER_TOKEN"] == "tok"
    assert plan.prefill_urls == [f"http://127.0.0.1:{p}" for p in ports[:2]]
    metaserver = plan.children[0]
    assert metaserver.env["PD_METASERVER_TOKEN"] == "tok" and "tok" not in metaserver.argv


def test_plan_roles_give_each_part_its_own_credential(tmp_path: Path) -> None:
    """``--roles``: the metaserver loads the written file; each engine's token acts as that
    engine alone, the proxy's as a proxy; no token is on a command line."""
    plan = build_plan(options(model="/m/tiny", prefill=2, decode=1, credentials_dir=str(tmp_path)))
    ms = plan.children[0]
    path = Path(ms.argv[ms.argv.index("--credentials-file") + 1])
    assert path.parent == tmp_path and path.stat().st_mode & 0o077 == 0
    access = Access.load(None, path, protect_reads=False)
    assert access.mode == "roles"
    tokens = set()
    for child in plan.children[1:]:
        token = child.env.get("PDGATE_METASERVER_TOKEN") or child.env["PD_PROXY_METASERVER_TOKEN"]
        tokens.add(token)
        assert token not in " ".join(c for ch in plan.children for c in ch.argv)
        who = resolved(access, f"Bearer {token}")
        if child.kind == "engine":
            assert who.role is Role.ENGINE and who.covers(child.name)
            assert not any(who.covers(o.name) for o in plan.children if o is not child)
        else:
            assert who.role is Role.PROXY
    assert len(tokens) == 4
    admin = (tmp_path / ADMIN_TOKEN).read_text().strip()
    assert resolved(access, f"Bearer {admin}").role is Role.ADMIN


def test_plan_device_presets() -> None:
    for device, protocol in (("cpu", "tcp"), ("cuda", "rdma"), ("npu", "ascend")):
        plan = build_plan(options(model="m", device=device))
        extra = kv_config(plan.children[1].argv)["kv_connector_extra_config"]
        assert isinstance(extra, dict)
        assert extra["mooncake_protocol"] == protocol and extra["device"] == device
    cpu = build_plan(options(model="m")).children[1]
    assert cpu.env["VLLM_CPU_KVCACHE_SPACE"] == "1"
    # engines sharing the host's cores: OpenMP threads sleep at barriers instead of spinning
    assert cpu.env["OMP_WAIT_POLICY"] == "PASSIVE"
    gpu = build_plan(options(model="m", device="cuda")).children[1]
    assert "OMP_WAIT_POLICY" not in gpu.env
    assert "--gpu-memory-utilization" in cpu.argv


def test_plan_extra_connector_config_and_engine_env_reach_every_engine() -> None:
    opts = options(
        model="m",
        extra_connector_config={"verify_kv": True, "kv_load_timeout_s": 9.0},
        extra_engine_env={"PDGATE_ALLOW_TEST_HOOKS": "1"},
    )
    engines = [c for c in build_plan(opts).children if c.kind == "engine"]
    assert len(engines) == 2
    for child in engines:
        extra = kv_config(child.argv)["kv_connector_extra_config"]
        assert isinstance(extra, dict)
        assert extra["verify_kv"] is True and extra["kv_load_timeout_s"] == 9.0  # extra wins
        assert extra["transport"] == "mooncake"  # the rest is unchanged
        assert child.env["PDGATE_ALLOW_TEST_HOOKS"] == "1"
        assert child.env["VLLM_CPU_KVCACHE_SPACE"] == "1"
    plain = build_plan(options(model="m")).children[1]
    assert "PDGATE_ALLOW_TEST_HOOKS" not in plain.env
    assert "verify_kv" not in kv_config(plain.argv)["kv_connector_extra_config"]  # type: ignore[operator]


def test_plan_nixl_connector_configures_pull_engines_and_prefill_first_proxy() -> None:
    plan = build_plan(
        options(model="m", prefill=1, decode=2, connector="nixl", flow="prefill-first")
    )
    engines = [c for c in plan.children if c.kind == "engine"]
    sides = []
    for child in engines:
        cfg = kv_config(child.argv)
        assert cfg["kv_connector"] == "NixlConnector" and "kv_connector_module_path" not in cfg
        assert cfg["kv_role"] == (
            "kv_producer" if child.name.startswith("prefill") else "kv_consumer"
        )
        assert cfg["kv_buffer_device"] == "cpu"
        assert cfg["kv_connector_extra_config"] == {"backends": ["UCX"]}
        assert child.env["VLLM_NIXL_SIDE_CHANNEL_HOST"] == "127.0.0.1"
        sides.append(child.env["VLLM_NIXL_SIDE_CHANNEL_PORT"])
        assert child.env["VLLM_CPU_KVCACHE_SPACE"] == "1"  # the device preset still applies
    assert len(set(sides)) == 3  # every engine listens for NIXL handshakes on its own port
    proxy = plan.children[-1]
    assert proxy.argv[proxy.argv.index("--flow") + 1] == "prefill-first"
    cuda = build_plan(options(model="m", device="cuda", connector="nixl", flow="prefill-first"))
    assert kv_config(cuda.children[1].argv)["kv_buffer_device"] == "cuda"


def test_plan_pdgate_connector_rejects_prefill_first() -> None:
    with pytest.raises(ValueError, match="pull connector"):
        build_plan(options(model="m", flow="prefill-first"))


def test_plan_nixl_rejects_push_flows_and_npu() -> None:
    for flow in ("decode-first", "concurrent"):
        with pytest.raises(ValueError, match="prefill-first"):
            build_plan(options(model="m", connector="nixl", flow=flow))
    with pytest.raises(ValueError, match="npu"):
        build_plan(options(model="m", device="npu", connector="nixl", flow="prefill-first"))
    direct = build_plan(options(model="m", connector="nixl", flow="direct"))
    assert direct.children[-1].argv[direct.children[-1].argv.index("--flow") + 1] == "direct"


def test_plan_default_flow_follows_the_connector() -> None:
    from launch.cli import build_parser, options_from

    nixl = options_from(build_parser().parse_args(["--model", "m", "--connector", "nixl"]), None)
    assert (nixl.connector, nixl.flow) == ("nixl", "prefill-first")
    plain = options_from(build_parser().parse_args(["--model", "m"]), None, KEY_FILE)
    assert (plain.connector, plain.flow) == ("pdgate", "decode-first")  # defaults unchanged
    assert kv_config(build_plan(plain).children[1].argv)["kv_connector"] == "PdgateConnector"


def test_plan_engine_args_reach_every_engine_and_nothing_else() -> None:
    from launch.cli import build_parser, options_from

    argv = ["--model", "m", "--decode", "2", "--engine-arg=--enforce-eager"]
    o = options_from(build_parser().parse_args([*argv, "--engine-arg=--seed=1"]), None, KEY_FILE)
    plan = build_plan(o)
    for child in plan.children:
        has = "--enforce-eager" in child.argv and "--seed=1" in child.argv
        assert has == (child.kind == "engine"), child.name


def test_plan_ascend_connector_runs_unchanged_vllm_ascend_engines() -> None:
    from launch.cli import build_parser, options_from

    argv = ["--model", "m", "--device", "npu", "--connector", "ascend", "--decode", "2"]
    o = options_from(build_parser().parse_args([*argv, "--tp-decode", "2"]), None, KEY_FILE)
    assert o.flow == "ascend-layerwise"
    plan = build_plan(o)
    engines = [c for c in plan.children if c.kind == "engine"]
    ports = []
    for child in engines:
        cfg = kv_config(child.argv)
        producer = child.name.startswith("prefill")
        assert cfg == {
            "kv_connector": "MooncakeLayerwiseConnector",
            "kv_role": "kv_producer" if producer else "kv_consumer",
            "kv_port": cfg["kv_port"],
            "kv_connector_extra_config": {
                "prefill": {"dp_size": 1, "tp_size": 1},
                "decode": {"dp_size": 1, "tp_size": 2},
            },
        }
        assert isinstance(cfg["kv_port"], str)  # a string, as vllm-ascend's docs write it
        ports.append(int(cfg["kv_port"]))
        assert "PDGATE_METASERVER_TOKEN" not in child.env
    assert len(set(ports)) == 3
    ms = plan.children[0].argv
    d_ports = ports[1:]
    assert ms[ms.index("--ascend-decode") + 1] == ",".join(
        f"127.0.0.1:{p}-{p + 1}" for p in d_ports
    )  # each D's side channel: kv_port + tp rank
    proxy = plan.children[-1].argv
    assert proxy[proxy.index("--flow") + 1] == "ascend-layerwise"


def test_plan_ascend_connector_needs_npu_and_its_flow() -> None:
    with pytest.raises(ValueError, match="npu"):
        build_plan(options(model="m", connector="ascend", flow="ascend-layerwise"))
    with pytest.raises(ValueError, match="does not drive"):
        build_plan(options(model="m", device="npu", connector="ascend", flow="decode-first"))
    with pytest.raises(ValueError, match="--connector ascend"):
        build_plan(options(model="m", device="npu", flow="ascend-layerwise"))


def test_plan_smollm2_by_its_short_name_serves_the_built_checkpoint(tmp_path: Path) -> None:
    # building it (download and dequantize, about 2 minutes) is make demo's; here the
    # short name must resolve to a finished build, and never to a half-built one
    from launch import smollm2
    from launch.cli import build_parser, options_from

    built = tmp_path / smollm2.FOLDER
    built.mkdir()
    (built / "config.json").write_text("{}")
    assert smollm2.ready(tmp_path) is None  # no weights yet: not ready
    (built / smollm2.WEIGHTS).write_bytes(b"")
    argv = ["--model", "smollm2", "--model-cache", str(tmp_path)]
    opts = options_from(build_parser().parse_args(argv), None, KEY_FILE)
    assert opts.model == str(built)


def test_plan_side_channel_secret_reaches_every_pdgate_engine(tmp_path: Path) -> None:
    opts = options(model="m", prefill=2, decode=1, side_channel_secret_file="/s/key")
    engines = [c for c in build_plan(opts).children if c.kind == "engine"]
    for child in engines:
        extra = kv_config(child.argv)["kv_connector_extra_config"]
        assert isinstance(extra, dict) and extra["side_channel_secret_file"] == "/s/key"


def test_plan_refuses_pdgate_engines_without_a_side_channel_key() -> None:
    """The connector would refuse to start them: the plan says why before anything starts. An
    unauthenticated side channel is only what is asked for by name."""
    with pytest.raises(ValueError, match="side-channel key"):
        build_plan(LaunchOptions(model="m"))
    insecure = LaunchOptions(model="m", extra_connector_config={"insecure_side_channel": True})
    extra = kv_config(build_plan(insecure).children[1].argv)["kv_connector_extra_config"]
    assert isinstance(extra, dict) and extra["insecure_side_channel"] is True
    assert "side_channel_secret_file" not in extra
    nixl = LaunchOptions(model="m", connector="nixl", flow="prefill-first")
    assert build_plan(nixl)  # vLLM's NixlConnector has no such key


def test_pd_launch_makes_a_private_key_or_refuses_a_bad_one_before_starting(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from launch import cli
    from pdservice.keys import load_keys

    made = Path(cli.new_secret_file(tmp_path))
    assert made.stat().st_mode & 0o777 == 0o600 and len(load_keys(made)) == 1
    (other := tmp_path / "other").mkdir()
    assert made.read_text() != Path(cli.new_secret_file(other)).read_text()
    short = tmp_path / "short.key"
    short.write_text("short\n")
    with pytest.raises(SystemExit, match="shorter than 16 bytes"):
        cli.main(["--model", "m", "--side-channel-secret-file", str(short)])


def test_plan_kv_routing(tmp_path: Path) -> None:
    model = tmp_path / "m"
    model.mkdir()
    (model / "tokenizer_config.json").write_text("{}")
    opts = options(model=str(model), prefill=2, decode=1, kv_events_base_port=5700)
    plan = build_plan(replace(opts, kv_routing=True))
    by = {c.name: c.argv for c in plan.children}
    assert "--kv-events" in by["metaserver"]
    endpoints = []
    for name in ("prefill-0", "prefill-1", "decode-0"):
        cfg = json.loads(by[name][by[name].index("--kv-events-config") + 1])
        assert cfg["enable_kv_cache_events"] is True and cfg["publisher"] == "zmq"
        endpoints.append((cfg["endpoint"], cfg["replay_endpoint"]))
    # bound to the launch host (127.0.0.1) only: see test_launch_defaults.py
    assert endpoints == [
        ("tcp://[::ffff:127.0.0.1]:5700", "tcp://127.0.0.1:5701"),
        ("tcp://[::ffff:127.0.0.1]:5702", "tcp://127.0.0.1:5703"),
        ("tcp://[::ffff:127.0.0.1]:5704", "tcp://127.0.0.1:5705"),
    ]
    proxy = by["proxy"]
    assert proxy[proxy.index("--prefill-policy") + 1] == "kv"
    assert proxy[proxy.index("--tokenizer") + 1] == str(model)
    plain = build_plan(options(model=str(model)))
    assert all("--kv-events-config" not in c.argv and "--kv-events" not in c.argv
               for c in plain.children)  # fmt: skip


@pytest.mark.parametrize(
    ("over", "why"),
    [
        ({"kv_routing": True}, "needs the engines' KV events"),
        ({"kv_events_base_port": 5700, "connector": "nixl", "flow": "prefill-first"}, "pdgate"),
        ({"kv_routing": True, "kv_events_base_port": 5700}, "local model directory"),
    ],
)
def test_plan_kv_routing_refused(over: dict[str, object], why: str) -> None:
    with pytest.raises(ValueError, match=why):
        build_plan(replace(options(model="/nowhere/m"), **over))  # type: ignore[arg-type]
