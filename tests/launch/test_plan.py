"""pd-launch's plan: ports, roles and the connector configuration every engine gets."""

from __future__ import annotations

import json

from launch.plan import LaunchOptions, build_plan


def kv_config(argv: list[str]) -> dict[str, object]:
    return dict(json.loads(argv[argv.index("--kv-transfer-config") + 1]))


def test_plan_wires_roles_ports_and_metaserver() -> None:
    plan = build_plan(LaunchOptions(model="/m/tiny", prefill=2, decode=2, token="tok"))
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


def test_plan_device_presets() -> None:
    for device, protocol in (("cpu", "tcp"), ("cuda", "rdma"), ("npu", "ascend")):
        plan = build_plan(LaunchOptions(model="m", device=device))  # type: ignore[arg-type]
        extra = kv_config(plan.children[1].argv)["kv_connector_extra_config"]
        assert isinstance(extra, dict)
        assert extra["mooncake_protocol"] == protocol and extra["device"] == device
    cpu = build_plan(LaunchOptions(model="m")).children[1]
    assert cpu.env["VLLM_CPU_KVCACHE_SPACE"] == "1"
    assert "--gpu-memory-utilization" in cpu.argv
