"""Issue 46 (security review 2): what the chart seals, protects and narrows by default, and
that each opt-out is explicit. Every check reads the rendered manifests; where a project parser
decides what a value means (the connector's key file), it is asked too."""

from __future__ import annotations

import copy
import json
import re
from pathlib import Path
from typing import Any

import helm_python as helm
import pytest

from pdservice.keys import load_keys
from tests.chart.fake_kube_api import FakeKubeAPI, serve
from tests.chart.rendering import (
    FULLNAME,
    NAMESPACE,
    RELEASE,
    SCENARIOS,
    Rendered,
    arg_after,
    container,
    parse,
    pod_spec,
    render,
)
from tests.chart.wiring import fake_secrets, mount_engine_files

ROLES = ("prefill", "decode")
SECRET = f"{FULLNAME}-auth"
ASCEND_KIND: dict[str, Any] = {
    **copy.deepcopy(SCENARIOS["ascend-2p1d-tp"]),
    "connector": {"kind": "vllm-ascend", "sideChannelPort": 36000},
}


def _engine(r: Rendered, role: str) -> tuple[dict[str, Any], dict[str, Any]]:
    sts = r.get("StatefulSet", f"{FULLNAME}-{role}")
    return pod_spec(sts), container(sts)


def _extra(c: dict[str, Any]) -> dict[str, Any]:
    extra: dict[str, Any] = json.loads(arg_after(c["args"], "--kv-transfer-config"))[
        "kv_connector_extra_config"
    ]
    return extra


def _upgrade(api: FakeKubeAPI, chart: helm.Chart, values: dict[str, Any]) -> Rendered:
    with serve(api) as url:
        config = helm.Config(kube_apiserver=url, kube_token="test", namespace=NAMESPACE)
        try:
            files = config.render(chart, values, name=RELEASE, namespace=NAMESPACE, is_upgrade=True)
        finally:
            config.close()
    return parse(files)


# --- side channel (SR2 "sealed by default in the chart?", N1) -------------------------------


@pytest.mark.parametrize("name", sorted(SCENARIOS))
def test_side_channel_key_is_generated_and_mounted_into_every_engine(
    renders: dict[str, Rendered], name: str, tmp_path: Path
) -> None:
    """Every pdgate-connector engine, in every value set, names a key file in
    side_channel_secret_file; the file is the release Secret's generated side-channel-key,
    mounted read-only, and the connector's own loader accepts it."""
    r = renders[name]
    key = r.secret_data(SECRET)["side-channel-key"]
    assert re.fullmatch(r"[A-Za-z0-9]{64}", key)
    secrets = fake_secrets(r)
    for role in ROLES:
        pod, c = _engine(r, role)
        path = _extra(c)["side_channel_secret_file"]
        assert "insecure_side_channel" not in _extra(c)
        (mount,) = [m for m in c["volumeMounts"] if path.startswith(m["mountPath"] + "/")]
        assert mount["readOnly"] is True
        volume = next(v for v in pod["volumes"] if v["name"] == mount["name"])
        assert volume["secret"]["secretName"] == SECRET
        assert volume["secret"]["items"] == [
            {"key": "side-channel-key", "path": "side-channel-key"}
        ]
        assert volume["secret"]["defaultMode"] == 0o440
        here = mount_engine_files(pod, c, secrets, tmp_path / role)
        local = path.replace(mount["mountPath"], here[mount["mountPath"]])
        assert load_keys(local) == [key.encode()]


def test_side_channel_key_is_random_and_kept_across_upgrades(chart: helm.Chart) -> None:
    first = render(chart=chart)
    assert (
        first.secret_data(SECRET)["side-channel-key"]
        != render(chart=chart).secret_data(SECRET)["side-channel-key"]
    )
    api = FakeKubeAPI()
    api.put_secret(first.get("Secret", SECRET))
    upgraded = _upgrade(api, chart, {"decode": {"replicas": 2}})
    assert (
        upgraded.secret_data(SECRET)["side-channel-key"]
        == first.secret_data(SECRET)["side-channel-key"]
    )


def test_side_channel_generated_key_yields_to_an_existing_secret_and_skips_vllm_ascend() -> None:
    """The generated key is the default; connector.sideChannelSecret.existingSecret replaces it
    (nothing generated), and vllm-ascend's own connector gets neither key nor mount."""
    assert "side-channel-key" in render().secret_data(SECRET)
    r = render(
        {
            "connector": {
                "sideChannelSecret": {"existingSecret": "pd-side", "existingSecretKey": "k"}
            }
        }
    )
    assert "side-channel-key" not in r.secret_data(SECRET)
    for role in ROLES:
        pod, c = _engine(r, role)
        assert _extra(c)["side_channel_secret_file"] == "/etc/pdgate/side-channel/k"
        secret_volumes = [v["secret"]["secretName"] for v in pod["volumes"] if "secret" in v]
        assert "pd-side" in secret_volumes and SECRET not in secret_volumes
    ascend = render(ASCEND_KIND)
    assert "side-channel-key" not in ascend.secret_data(SECRET)
    for role in ROLES:
        _, c = _engine(ascend, role)
        assert "side_channel" not in arg_after(c["args"], "--kv-transfer-config")
        assert not any(m["mountPath"].startswith("/etc/pdgate/") for m in c["volumeMounts"])


def test_side_channel_insecure_opt_out_is_explicit_and_announced() -> None:
    """connector.insecureSideChannel: no key, nothing mounted, and the connector is told so
    (insecure_side_channel: it refuses to start unsealed otherwise); NOTES.txt says INSECURE."""
    r = render({"connector": {"insecureSideChannel": True}})
    assert "side-channel-key" not in r.secret_data(SECRET)
    for role in ROLES:
        _, c = _engine(r, role)
        extra = _extra(c)
        assert extra["insecure_side_channel"] is True
        assert "side_channel_secret_file" not in extra
    assert "INSECURE" in r.notes and "connector.insecureSideChannel" in r.notes
    with pytest.raises(helm.HelmError, match="insecureSideChannel"):
        render(
            {
                "connector": {
                    "insecureSideChannel": True,
                    "sideChannelSecret": {"existingSecret": "pd-side"},
                }
            }
        )


# --- metaserver reads (SR2 "reads protected by default?", M6, N2, N6, N7) -------------------

AUTH_SCENARIOS = sorted(n for n, v in SCENARIOS.items() if v.get("auth", {}).get("enabled", True))


def _engine_credential(c: dict[str, Any]) -> str:
    """Where an engine container's connector takes its metaserver credential from."""
    env = {e["name"]: e for e in c.get("env", [])}
    extra = _extra(c)
    if "metaserver_token_file" in extra:
        return f"file {extra['metaserver_token_file']}"
    assert "secretKeyRef" in env["PDGATE_METASERVER_TOKEN"]["valueFrom"]
    return "env PDGATE_METASERVER_TOKEN"


def _drain_credential(c: dict[str, Any]) -> str:
    command = c["lifecycle"]["preStop"]["exec"]["command"]
    files = [a.split("=", 1)[1] for a in command if a.startswith("--token-file=")]
    if files:
        return f"file {files[0]}"
    env = {e["name"]: e for e in c.get("env", [])}
    assert "secretKeyRef" in env["PDGATE_METASERVER_TOKEN"]["valueFrom"]
    return "env PDGATE_METASERVER_TOKEN"


@pytest.mark.parametrize("name", AUTH_SCENARIOS)
def test_reads_are_protected_by_default_and_every_reader_holds_a_credential(
    renders: dict[str, Rendered], name: str
) -> None:
    """The metaserver runs --protect-reads; the proxy, each engine's connector and its preStop
    drain (all of them read the metaserver) hold a credential; NOTES' curl lines send one."""
    r = renders[name]
    ms = container(r.get("Deployment", f"{FULLNAME}-metaserver"))
    assert "--protect-reads" in ms["args"] and "--open-reads" not in ms["args"]
    proxy = {e["name"]: e for e in container(r.get("Deployment", f"{FULLNAME}-proxy"))["env"]}
    assert "secretKeyRef" in proxy["PD_PROXY_METASERVER_TOKEN"]["valueFrom"]
    for role in ROLES:
        _, c = _engine(r, role)
        assert _engine_credential(c) and _drain_credential(c)
    reads = [line.strip() for line in r.notes.splitlines() if "$META/v1/" in line]
    assert reads and all(line.startswith("ms ") for line in reads), reads  # with the token ...
    assert (
        """ms() { curl -s -H @<(printf 'Authorization: Bearer %s\\n' "$TOKEN") "$@"; }""" in r.notes
    )
    assert "Bearer $TOKEN" not in r.notes.replace("Bearer %s", "")  # ... on no command line


def test_open_reads_is_an_explicit_insecure_opt_out() -> None:
    r = render({"metaserver": {"protectReads": False}})
    args = container(r.get("Deployment", f"{FULLNAME}-metaserver"))["args"]
    assert "--open-reads" in args and "--protect-reads" not in args
    assert "INSECURE" in r.notes and "metaserver.protectReads=false" in r.notes


# --- an open metaserver is asked for by name (SR2 N9) ---------------------------------------


def test_auth_disabled_runs_the_metaserver_open_only_by_name(renders: dict[str, Rendered]) -> None:
    """pd-metaserver refuses to listen on a pod IP without credentials (sec-design.md): with
    auth.enabled=false the chart says PD_METASERVER_INSECURE_OPEN=true, and NOTES.txt calls it
    INSECURE; with auth on, it never does."""
    open_ = renders["cpu-1p1d-memory"]  # the example has auth.enabled=false
    env = {
        e["name"]: e for e in container(open_.get("Deployment", f"{FULLNAME}-metaserver"))["env"]
    }
    assert env["PD_METASERVER_INSECURE_OPEN"]["value"] == "true"
    assert "INSECURE" in open_.notes and "auth.enabled=false" in open_.notes
    for name in AUTH_SCENARIOS:
        ms = container(renders[name].get("Deployment", f"{FULLNAME}-metaserver"))
        assert all(e["name"] != "PD_METASERVER_INSECURE_OPEN" for e in ms["env"]), name
        assert "INSECURE" not in renders[name].notes, name


# --- engine API key (SR2 H4: direct engine HTTP) --------------------------------------------


def _vllm_app(monkeypatch: pytest.MonkeyPatch, env: dict[str, str]) -> Any:
    """A FastAPI app with vLLM's own middleware set up the way `vllm serve` does it, from the
    engine container's environment (VLLM_API_KEY), and stand-ins for three of its routes."""
    from argparse import Namespace

    from fastapi import FastAPI
    from fastapi.testclient import TestClient
    from vllm.entrypoints.serve.middleware.register import init_entrypoints_middleware

    for key, value in env.items():
        monkeypatch.setenv(key, value)
    app = FastAPI()
    for path in ("/health", "/metrics", "/v1/models"):
        app.add_api_route(path, lambda: {"ok": True})
    args = Namespace(
        allowed_origins=["*"],
        allow_credentials=False,
        allowed_methods=["*"],
        allowed_headers=["*"],
        api_key=None,
        enable_request_id_headers=False,
        middleware=[],
    )
    init_entrypoints_middleware(args, app, ())
    return TestClient(app)


@pytest.mark.parametrize("name", sorted(SCENARIOS))
def test_engine_api_key_is_generated_and_only_the_proxy_holds_it(
    renders: dict[str, Rendered], name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """engine-api-key: the engines' VLLM_API_KEY (vLLM's --api-key) and the proxy's
    PD_PROXY_ENGINE_API_KEY, both through secretKeyRef, never in an argv; with it vLLM's own
    middleware refuses /v1 without the proxy's key, while the probes' /health and the drain's
    /metrics stay open."""
    from vllm.entrypoints.serve.middleware.authenticate import GUARDED_PREFIX

    from tests.chart.rendering import resolve_env
    from tests.chart.wiring import fields

    r = renders[name]
    key = r.secret_data(SECRET)["engine-api-key"]
    assert re.fullmatch(r"[A-Za-z0-9]{48}", key)
    ref = {"name": SECRET, "key": "engine-api-key"}
    secrets = fake_secrets(r)
    proxy = container(r.get("Deployment", f"{FULLNAME}-proxy"))
    (item,) = [e for e in proxy["env"] if e["name"] == "PD_PROXY_ENGINE_API_KEY"]
    assert item["valueFrom"]["secretKeyRef"] == ref
    proxy_key = resolve_env(proxy, secrets=secrets, fields=fields("proxy-0"))[item["name"]]
    for w in r.workloads():
        for c in pod_spec(w)["containers"] + pod_spec(w).get("initContainers", []):
            assert not any("api-key" in a for a in c.get("args", []) + c.get("command", []))
    for role in ROLES:
        _, c = _engine(r, role)
        (item,) = [e for e in c["env"] if e["name"] == "VLLM_API_KEY"]
        assert item["valueFrom"]["secretKeyRef"] == ref
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            assert not c[probe]["httpGet"]["path"].startswith(GUARDED_PREFIX), probe
        engine = c["lifecycle"]["preStop"]["exec"]["command"]
        assert any(a.startswith("--engine=") for a in engine)  # reads vLLM's /metrics
    env = resolve_env(c, secrets=secrets, fields=fields(f"{FULLNAME}-decode-0"))
    client = _vllm_app(monkeypatch, {"VLLM_API_KEY": env["VLLM_API_KEY"]})
    assert client.get("/health").status_code == 200
    assert client.get("/metrics").status_code == 200
    assert client.get("/v1/models").status_code == 401
    wrong = client.get("/v1/models", headers={"Authorization": "Bearer not-the-key"})
    assert wrong.status_code == 401
    ok = client.get("/v1/models", headers={"Authorization": f"Bearer {proxy_key}"})
    assert ok.status_code == 200


def test_engine_api_key_existing_secret_and_the_insecure_opt_out() -> None:
    theirs = render({"engine": {"apiKey": {"existingSecret": "eng-key", "existingSecretKey": "k"}}})
    assert "engine-api-key" not in theirs.secret_data(SECRET)
    proxy = container(theirs.get("Deployment", f"{FULLNAME}-proxy"))
    refs = [e["valueFrom"]["secretKeyRef"] for e in proxy["env"] if e["name"].endswith("API_KEY")]
    assert refs == [{"name": "eng-key", "key": "k"}]
    off = render({"engine": {"apiKey": {"enabled": False}}})
    assert "engine-api-key" not in off.secret_data(SECRET)
    assert "API_KEY" not in off.text()
    assert "INSECURE" in off.notes and "engine.apiKey.enabled=false" in off.notes


def test_engine_api_key_is_random_and_kept_across_upgrades(chart: helm.Chart) -> None:
    first = render(chart=chart)
    key = first.secret_data(SECRET)["engine-api-key"]
    assert key != render(chart=chart).secret_data(SECRET)["engine-api-key"]
    api = FakeKubeAPI()
    api.put_secret(first.get("Secret", SECRET))
    assert _upgrade(api, chart, {}).secret_data(SECRET)["engine-api-key"] == key


# --- per-pod engine identity (SR2 N4, N10; sec-design.md "kubernetes:" credentials) ----------

TOKEN_DIR = "/var/run/secrets/pdgate/metaserver-token"
TOKEN_FILE = f"{TOKEN_DIR}/token"
PER_POD = sorted(
    n
    for n, v in SCENARIOS.items()
    if v.get("auth", {}).get("enabled", True)
    and v.get("auth", {}).get("mode", "roles") == "roles"
    and v.get("auth", {}).get("engineIdentity", "serviceAccountToken") == "serviceAccountToken"
)


def _credentials(r: Rendered) -> list[dict[str, Any]]:
    import yaml

    text = r.get("ConfigMap", f"{FULLNAME}-access")["data"]["credentials.yaml"]
    entries: list[dict[str, Any]] = yaml.safe_load(text)["credentials"]
    return entries


@pytest.mark.parametrize("name", PER_POD)
def test_engines_prove_their_pod_with_a_projected_service_account_token(
    renders: dict[str, Rendered], name: str
) -> None:
    """Each pool runs under a ServiceAccount of its own, with no API token mounted; the pod
    gets a projected token for the metaserver's audience instead, which the connector
    (metaserver_token_file) and the preStop drain (--token-file) present. No pool token is
    generated or read any more."""
    r = renders[name]
    for role in ROLES:
        pod, c = _engine(r, role)
        sa = pod["serviceAccountName"]
        assert sa == f"{FULLNAME}-{role}"
        account = r.get("ServiceAccount", sa)
        assert account["automountServiceAccountToken"] is False
        assert pod["automountServiceAccountToken"] is False
        (volume,) = [v for v in pod["volumes"] if "projected" in v]
        assert volume["projected"]["sources"] == [
            {
                "serviceAccountToken": {
                    "audience": "pdgate-metaserver",
                    "expirationSeconds": 3600,
                    "path": "token",
                }
            }
        ]
        (mount,) = [m for m in c["volumeMounts"] if m["name"] == volume["name"]]
        assert mount == {"name": volume["name"], "mountPath": TOKEN_DIR, "readOnly": True}
        if SCENARIOS[name].get("connector", {}).get("kind", "pdgate") == "pdgate":
            assert _extra(c)["metaserver_token_file"] == TOKEN_FILE
        assert f"--token-file={TOKEN_FILE}" in c["lifecycle"]["preStop"]["exec"]["command"]
        assert all(e["name"] != "PDGATE_METASERVER_TOKEN" for e in c["env"])
    if r.has("Secret", SECRET):
        data = r.secret_data(SECRET)
        assert "prefill-token" not in data and "decode-token" not in data


@pytest.mark.parametrize("name", PER_POD)
def test_metaserver_credentials_name_each_pools_service_account(
    renders: dict[str, Rendered], name: str
) -> None:
    """credentials.yaml: the proxy keeps its token; each pool is a `kubernetes:` entry naming
    the ServiceAccount its pods run under (role engine, engine_role of the pool), no token."""
    r = renders[name]
    entries = {e["name"]: e for e in _credentials(r)}
    assert entries.pop("proxy") == {
        "name": "proxy",
        "role": "proxy",
        "token_file": "/etc/pdgate/auth/proxy-token",
    }
    for role in ROLES:
        pod, _ = _engine(r, role)
        assert entries.pop(f"{role}-pods") == {
            "name": f"{role}-pods",
            "role": "engine",
            "engine_role": role,
            "kubernetes": {"service_account": f"{NAMESPACE}:{pod['serviceAccountName']}"},
        }
    assert entries == {}
    ms = pod_spec(r.get("Deployment", f"{FULLNAME}-metaserver"))
    (creds,) = [v for v in ms["volumes"] if v["name"] == "credentials"]
    assert creds["secret"]["items"] == [{"key": "proxy-token", "path": "proxy-token"}]


def test_metaserver_gets_rbac_for_token_reviews_and_pod_lookups(
    renders: dict[str, Rendered],
) -> None:
    """The metaserver (its own ServiceAccount, API token mounted) may create TokenReviews
    (system:auth-delegator) and get pods in the release namespace, nothing else; no other
    pod runs under that account, and the engines' accounts are bound to nothing."""
    r = renders["defaults"]
    ms = pod_spec(r.get("Deployment", f"{FULLNAME}-metaserver"))
    sa = ms["serviceAccountName"]
    assert sa == f"{FULLNAME}-metaserver" and ms["automountServiceAccountToken"] is True
    assert r.has("ServiceAccount", sa)
    subject = [{"kind": "ServiceAccount", "name": sa, "namespace": NAMESPACE}]
    (crb,) = r.of_kind("ClusterRoleBinding")
    assert crb["roleRef"] == {
        "apiGroup": "rbac.authorization.k8s.io",
        "kind": "ClusterRole",
        "name": "system:auth-delegator",
    }
    assert crb["subjects"] == subject and NAMESPACE in crb["metadata"]["name"]
    (role,) = r.of_kind("Role")
    assert role["rules"] == [{"apiGroups": [""], "resources": ["pods"], "verbs": ["get"]}]
    (rb,) = r.of_kind("RoleBinding")
    assert rb["roleRef"] == {
        "apiGroup": "rbac.authorization.k8s.io",
        "kind": "Role",
        "name": role["metadata"]["name"],
    }
    assert rb["subjects"] == subject
    assert not r.of_kind("ClusterRole")
    others = [
        pod_spec(w) for w in r.workloads() if w["metadata"]["name"] != f"{FULLNAME}-metaserver"
    ]
    assert all(p["serviceAccountName"] != sa for p in others)
    assert all(p["automountServiceAccountToken"] is False for p in others)


def test_pool_tokens_remain_as_the_named_alternative() -> None:
    """auth.engineIdentity=poolToken: today's per-pool tokens, no RBAC, no projected token;
    in single-token mode or without auth there is no per-pod identity either."""
    r = render({"auth": {"engineIdentity": "poolToken"}})
    assert {"prefill-token", "decode-token"} <= set(r.secret_data(SECRET))
    assert not r.of_kind("ClusterRoleBinding") and not r.of_kind("Role")
    for role in ROLES:
        pod, c = _engine(r, role)
        assert not any("projected" in v for v in pod["volumes"])
        assert "metaserver_token_file" not in _extra(c)
        env = {e["name"]: e for e in c["env"]}
        assert env["PDGATE_METASERVER_TOKEN"]["valueFrom"]["secretKeyRef"]["key"] == f"{role}-token"
    entries = {e["name"]: e for e in _credentials(r)}
    assert entries["prefill-pool"]["token_file"] == "/etc/pdgate/auth/prefill-token"
    assert "per-pool" in r.notes
    for values in ({"auth": {"mode": "single"}}, {"auth": {"enabled": False}}):
        other = render(values)
        assert not other.of_kind("ClusterRoleBinding") and not other.of_kind("Role"), values
        assert not any(
            "projected" in v for w in other.workloads() for v in pod_spec(w).get("volumes", [])
        )


# --- engine pods' securityContext (SR2 M6) --------------------------------------------------

# The engine image each accelerator preset runs (docker/*.Dockerfile).
PRESET_DOCKERFILES = {
    "cpu": "engine-cpu.Dockerfile",
    "nvidia": "engine-cuda.Dockerfile",
    "ascend": "engine-ascend.Dockerfile",
}


def _image_user(accelerator: str) -> str | None:
    from tests.chart.dockerfiles import DOCKER_DIR
    from tests.chart.dockerfiles import parse as parse_dockerfile

    user = parse_dockerfile(DOCKER_DIR / PRESET_DOCKERFILES[accelerator]).final.last("USER")
    return None if user is None else str(user.value[0]).split(":")[0]


@pytest.mark.parametrize("name", sorted(SCENARIOS))
def test_engine_pods_run_with_a_restrictive_security_context(
    renders: dict[str, Rendered], name: str
) -> None:
    """Engines: RuntimeDefault seccomp, no privilege escalation, every capability dropped; added
    back only IPC_LOCK for RDMA and, for the Ascend image (root: the driver's device nodes
    belong to HwHiAiUser), DAC_OVERRIDE. runAsNonRoot exactly where the preset's image has a
    numeric non-root USER (the kubelet can verify only that). The proxy, metaserver and Redis
    pods hold the same line (and more: a fixed non-root uid, a read-only root)."""
    r = renders[name]
    values = SCENARIOS[name]
    accel = values.get("accelerator", "cpu")
    rdma = values.get("engine", {}).get("rdma", {}).get("enabled", False)
    user = _image_user(accel)
    for role in ROLES:
        pod, c = _engine(r, role)
        assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
        sc = c["securityContext"]
        assert sc["allowPrivilegeEscalation"] is False
        assert sc["capabilities"]["drop"] == ["ALL"]
        wanted = ({"IPC_LOCK"} if rdma else set()) | (
            {"DAC_OVERRIDE"} if accel == "ascend" else set()
        )
        assert set(sc["capabilities"].get("add", [])) == wanted
        assert "privileged" not in sc
        if user is not None and user.isdigit() and user != "0":
            assert pod["securityContext"]["runAsNonRoot"] is True
        else:
            assert accel == "ascend" and "runAsNonRoot" not in pod["securityContext"]
    for w in r.workloads():
        if w["kind"] == "StatefulSet" and w["metadata"]["name"].endswith(ROLES):
            continue
        spec = pod_spec(w)
        assert spec["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
        assert spec["securityContext"]["runAsNonRoot"] is True
        for c in spec["containers"] + spec.get("initContainers", []):
            sc = c["securityContext"]
            assert sc["allowPrivilegeEscalation"] is False and sc["readOnlyRootFilesystem"] is True
            assert sc["capabilities"] == {"drop": ["ALL"]}


# --- NetworkPolicy (SR2 H4, M6, N11) --------------------------------------------------------

METRICS_NS = {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}
MOONCAKE_PORT = 12345  # Mooncake picks its transfer ports at run time


@pytest.mark.parametrize("name", ["defaults", "kv-routing", "nvidia-4p2d-rdma", "observability"])
@pytest.mark.parametrize("role", ROLES)
def test_engine_network_policy_keeps_peers_to_kv_traffic(
    renders: dict[str, Rendered], name: str, role: str
) -> None:
    """Peer engines reach each other's side-channel and Mooncake ports (any TCP port, and UDP,
    as before) but neither vLLM's HTTP port (only the proxy calls it: a peer with a copied
    binding could otherwise drive P) nor, with kvRouting, the KV-event ports (prompt token ids;
    only the metaserver follows them)."""
    from tests.chart.wiring import MONITORING, admits

    r = renders[name]
    policy = r.get("NetworkPolicy", f"{FULLNAME}-{role}")
    _, c = _engine(r, role)
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    http = ports["http"]
    side = [p for n, p in ports.items() if n.startswith("side-")]
    events = [ports[n] for n in ("kv-events", "kv-replay") if n in ports]
    assert bool(events) == (name == "kv-routing")
    for peer in ROLES:
        for port in side + [MOONCAKE_PORT, 1, 65535]:
            assert admits(r, policy, peer, port, "TCP"), (peer, port)
        assert admits(r, policy, peer, MOONCAKE_PORT, "UDP")
        for port in [http, *events]:
            assert not admits(r, policy, peer, port, "TCP"), (peer, port)
    assert admits(r, policy, "proxy", http, "TCP")
    assert not any(admits(r, policy, "proxy", p, "TCP") for p in side + events)
    for port in events:
        assert admits(r, policy, "metaserver", port, "TCP")
    assert not admits(r, policy, "metaserver", http, "TCP")
    assert not any(admits(r, policy, "redis", p, "TCP") for p in [http, *side, *events])
    # the monitoring namespace (observability sets it) scrapes vLLM's /metrics on http only
    assert admits(r, policy, MONITORING, http, "TCP") == (name == "observability")
    assert not any(admits(r, policy, MONITORING, p, "TCP") for p in side + events)


def test_metrics_pod_selector_narrows_the_monitoring_namespace() -> None:
    """networkPolicy.metricsPodSelector: only the scraper's pods of the monitoring namespace
    (one peer with both selectors, so both must match), on the metaserver and the engines."""
    prom = {"matchLabels": {"app.kubernetes.io/name": "prometheus"}}
    r = render(
        {"networkPolicy": {"metricsNamespaceSelector": METRICS_NS, "metricsPodSelector": prom}}
    )
    for name in ("metaserver", *ROLES):
        policy = r.get("NetworkPolicy", f"{FULLNAME}-{name}")
        peers = [p for rule in policy["spec"]["ingress"] for p in rule.get("from", [])]
        (monitoring,) = [p for p in peers if "namespaceSelector" in p]
        assert monitoring == {"namespaceSelector": METRICS_NS, "podSelector": prom}
