"""Each engine pool's vLLM command line: model flags, accelerator, and the connector's
--kv-transfer-config as the connector itself parses it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from vllm.config import KVTransferConfig

from connector.config import load_settings as load_connector_settings
from tests.chart.rendering import (
    FULLNAME,
    SCENARIOS,
    Rendered,
    arg_after,
    container,
    expand,
    flags,
    pod_spec,
    resolve_env,
    var_refs,
)
from tests.chart.wiring import container_port, fake_secrets, fields, mount_engine_files, rebase

ROLES = {"prefill": "kv_producer", "decode": "kv_consumer"}
PROTOCOLS = {"cpu": "tcp", "nvidia": "rdma", "ascend": "ascend"}
DEVICES = {"cpu": "cpu", "nvidia": "cuda", "ascend": "npu"}
RESOURCES = {"nvidia": "nvidia.com/gpu", "ascend": "huawei.com/Ascend910"}
TOKEN_FILE = "/var/run/secrets/pdgate/metaserver-token/token"


@pytest.mark.parametrize("role", sorted(ROLES))
def test_engine_kv_transfer_config(
    scenario: tuple[str, Rendered], role: str, tmp_path: Path
) -> None:
    name, r = scenario
    values = SCENARIOS[name]
    accel = values.get("accelerator", "cpu")
    sts = r.get("StatefulSet", f"{FULLNAME}-{role}")
    c = container(sts)
    raw = arg_after(c["args"], "--kv-transfer-config")
    cfg = json.loads(raw)
    assert cfg["kv_connector"] == "PdgateConnector"
    assert cfg["kv_connector_module_path"] == "connector"
    assert cfg["kv_role"] == ROLES[role]
    extra = cfg["kv_connector_extra_config"]
    assert extra["metaserver_url"] == f"http://{FULLNAME}-metaserver:8300"
    assert "metaserver_token" not in extra, "the token comes from the Secret, not the flag"
    assert extra["mooncake_protocol"] == PROTOCOLS[accel]
    assert extra["device"] == DEVICES[accel]
    assert extra["concurrent"] == (role == "prefill" and name == "concurrent-flow")
    connector = values.get("connector", {})
    assert cfg["kv_load_failure_policy"] == connector.get("kvLoadFailurePolicy", "recompute")
    assert extra["kv_load_timeout_s"] == connector.get("kvLoadTimeoutS", 120)
    KVTransferConfig(**cfg)  # vLLM's own validation of the flag's value

    # What the connector sees once the kubelet has expanded $(POD_NAME) and $(POD_IP) and
    # mounted the pod's Secret volumes (under tmp_path here: the key file is read at start).
    pod = f"{FULLNAME}-{role}-0"
    secrets = fake_secrets(r)
    env = resolve_env(c, secrets=secrets, fields=fields(pod))
    for ref in var_refs(raw) | {v for a in c["args"] for v in var_refs(a)}:
        assert ref in env, f"$({ref}) in args but not in the container's env"
    mounted = mount_engine_files(pod_spec(sts), c, secrets, tmp_path)
    settings = load_connector_settings(
        json.loads(rebase(expand(raw, env), mounted))["kv_connector_extra_config"]
    )
    assert settings.instance_id == pod
    assert settings.http_url == f"http://10.1.2.3:{container_port(c, 'http')}"
    assert settings.side_channel_host == "10.1.2.3"
    auth = values.get("auth", {})
    if not auth.get("enabled", True):
        assert "PDGATE_METASERVER_TOKEN" not in env
    elif auth.get("mode", "roles") == "roles" and auth.get("engineIdentity") != "poolToken":
        # per-pod identity (issue 46): the pod's projected ServiceAccount token, mounted
        assert "PDGATE_METASERVER_TOKEN" not in env
        assert settings.metaserver_token_file == rebase(TOKEN_FILE, mounted)
        assert Path(settings.metaserver_token_file).read_text()
    else:
        assert env["PDGATE_METASERVER_TOKEN"]

    # One side-channel port per TP rank, declared on the container and the headless Service.
    tp = values.get(role, {}).get("tensorParallelSize", 1)
    assert int(flags(c["args"])["tensor-parallel-size"]) == tp
    side = [p["containerPort"] for p in c["ports"] if p["name"].startswith("side-")]
    assert side == [settings.side_channel_port + rank for rank in range(tp)]
    svc = r.get("Service", f"{FULLNAME}-{role}")
    assert sorted(p["port"] for p in svc["spec"]["ports"] if p["name"].startswith("side-")) == side


def test_engine_pools_share_the_kv_load_deadline_and_policy(scenario: tuple[str, Rendered]) -> None:
    """P stops writing into D's blocks at D's deadline: both must use the same one."""
    _, r = scenario
    cfgs = [
        json.loads(
            arg_after(
                container(r.get("StatefulSet", f"{FULLNAME}-{role}"))["args"],
                "--kv-transfer-config",
            )
        )
        for role in ROLES
    ]
    assert len({c["kv_connector_extra_config"]["kv_load_timeout_s"] for c in cfgs}) == 1
    assert len({c["kv_load_failure_policy"] for c in cfgs}) == 1


@pytest.mark.parametrize("role", sorted(ROLES))
def test_engine_command_and_accelerator(scenario: tuple[str, Rendered], role: str) -> None:
    name, r = scenario
    values = SCENARIOS[name]
    accel = values.get("accelerator", "cpu")
    model = values.get("model", {})
    c = container(r.get("StatefulSet", f"{FULLNAME}-{role}"))
    model_name = model.get("name", "Qwen/Qwen2.5-0.5B-Instruct")
    if accel == "cpu":
        assert c["command"] == ["python3", "-m", "vllm.entrypoints.openai.api_server"]
        assert f"--model={model_name}" in c["args"]
    else:
        assert c["command"] == ["vllm", "serve"] and c["args"][0] == model_name
    f = flags(c["args"])
    assert f["served-model-name"] == model.get("servedName", model_name)
    assert int(f["max-model-len"]) == model.get("maxModelLen", 4096)
    if "maxNumBatchedTokens" in model:
        assert int(f["max-num-batched-tokens"]) == model["maxNumBatchedTokens"]
        assert int(f["max-num-seqs"]) == model["maxNumSeqs"]
    tp = values.get(role, {}).get("tensorParallelSize", 1)
    limits = c["resources"]["limits"]
    if accel in RESOURCES:
        assert limits[RESOURCES[accel]] == tp
        assert c["resources"]["requests"][RESOURCES[accel]] == tp
    else:
        assert not any("/" in k for k in limits)
    images = {"cpu": "engine-cpu", "nvidia": "engine-cuda", "ascend": "engine-ascend"}
    assert c["image"] == f"pdgate/{images[accel]}:0.1.0"
    spec = pod_spec(r.get("StatefulSet", f"{FULLNAME}-{role}"))
    mounts = {m["mountPath"] for m in c["volumeMounts"]}
    assert "/dev/shm" in mounts and "/models" in mounts
    shm = next(v for v in spec["volumes"] if v["name"] == "shm")
    assert shm["emptyDir"]["medium"] == "Memory"
    if accel == "ascend":
        assert "/usr/local/Ascend/driver" in mounts
    if name == "nvidia-4p2d-rdma":
        assert spec["hostNetwork"] is True and spec["dnsPolicy"] == "ClusterFirstWithHostNet"
        assert limits["rdma/hca_shared_devices_a"] == 1
        assert "IPC_LOCK" in c["securityContext"]["capabilities"]["add"]
        assert (
            json.loads(arg_after(c["args"], "--kv-transfer-config"))["kv_connector_extra_config"][
                "device_name"
            ]
            == "mlx5_0"
        )
        claim = r.get("StatefulSet", f"{FULLNAME}-{role}")["spec"]["volumeClaimTemplates"][0]
        assert claim["metadata"]["name"] == "model-cache"
        env = resolve_env(c, secrets=fake_secrets(r), fields=fields("p-0"))
        assert env["HF_TOKEN"] == "hf-user-token" and env["HF_HOME"] == "/models"


@pytest.mark.parametrize("role", sorted(ROLES))
def test_engine_prestop_drains_within_the_grace_period(
    scenario: tuple[str, Rendered], role: str
) -> None:
    """The preStop hook runs the connector's drain (Python: the engine images have no curl)
    against the metaserver Service and this pod's own engine port; the grace period covers the
    longest drain plus vLLM's shutdown."""
    name, r = scenario
    drain = SCENARIOS[name].get("engine", {}).get("drain", {})
    sts = r.get("StatefulSet", f"{FULLNAME}-{role}")
    c = container(sts)
    command = c["lifecycle"]["preStop"]["exec"]["command"]
    assert command[:3] == ["python3", "-m", "connector.drain"]
    f = flags(command)
    assert f["metaserver"] == f"http://{FULLNAME}-metaserver:8300"
    assert f["engine"] == f"http://127.0.0.1:{container_port(c, 'http')}"
    assert int(f["settle"]) == drain.get("settleS", 10)
    assert int(f["timeout"]) == drain.get("timeoutS", 300)
    assert not any(var_refs(a) for a in command), "exec hooks get no $(VAR) expansion"
    env = {e["name"] for e in c["env"]}
    assert "POD_NAME" in env  # the drain's instance id, as the connector's
    grace = pod_spec(sts)["terminationGracePeriodSeconds"]
    assert grace >= int(f["timeout"]) + 30


def test_engine_drain_can_be_turned_off() -> None:
    from tests.chart.rendering import render

    r = render({"engine": {"drain": {"enabled": False}, "terminationGracePeriodSeconds": 30}})
    for role in ROLES:
        c = container(r.get("StatefulSet", f"{FULLNAME}-{role}"))
        assert "lifecycle" not in c
        assert (
            pod_spec(r.get("StatefulSet", f"{FULLNAME}-{role}"))["terminationGracePeriodSeconds"]
            == 30
        )


def test_engine_side_channel_secret_is_mounted_and_named_in_the_connector_config() -> None:
    from tests.chart.rendering import render

    values = {
        "connector": {"sideChannelSecret": {"existingSecret": "pd-side", "existingSecretKey": "k"}}
    }
    r = render(values)
    for role in ROLES:
        sts = r.get("StatefulSet", f"{FULLNAME}-{role}")
        c = container(sts)
        extra = json.loads(arg_after(c["args"], "--kv-transfer-config"))[
            "kv_connector_extra_config"
        ]
        mount = next(m for m in c["volumeMounts"] if m["name"] == "side-channel-secret")
        assert mount["readOnly"] is True
        assert extra["side_channel_secret_file"] == f"{mount['mountPath']}/k"
        volume = next(v for v in pod_spec(sts)["volumes"] if v["name"] == "side-channel-secret")
        assert volume["secret"]["secretName"] == "pd-side"
        assert volume["secret"]["items"] == [{"key": "k", "path": "k"}]
        assert volume["secret"]["defaultMode"] == 0o440
    # Without it the chart's generated key is mounted instead (issue 46: sealed by default;
    # tests/chart/test_secure_defaults.py); before, the side channel ran unsealed.
    plain = render({})
    for role in ROLES:
        sts = plain.get("StatefulSet", f"{FULLNAME}-{role}")
        raw = arg_after(container(sts)["args"], "--kv-transfer-config")
        assert '"side_channel_secret_file":"/etc/pdgate/side-channel/side-channel-key"' in raw
        volume = next(v for v in pod_spec(sts)["volumes"] if v["name"] == "side-channel-secret")
        assert volume["secret"]["secretName"] == f"{FULLNAME}-auth"
