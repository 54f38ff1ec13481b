"""The rendered objects are wired to each other: names, ports, labels, secrets, flags."""

from __future__ import annotations

import os
from pathlib import Path
from urllib.parse import urlsplit

import pytest

from metaserver.access import Access, Role
from metaserver.cli import load_settings as load_metaserver_settings
from proxy.cli import load_settings as load_proxy_settings
from tests.chart.rendering import (
    FULLNAME,
    NAMESPACE,
    SCENARIOS,
    USER_SECRETS,
    Rendered,
    container,
    flags,
    iter_containers,
    pod_spec,
    resolve_env,
)
from tests.chart.wiring import (
    container_port,
    fake_secrets,
    fields,
    matches,
    mount_credentials,
    pods_selected,
    service_for,
    svc_port,
)
from tests.support.access import resolved

# --- proxy ----------------------------------------------------------------------------------


def test_wiring_proxy_args_name_the_real_services(scenario: tuple[str, Rendered]) -> None:
    name, r = scenario
    proxy = container(r.get("Deployment", f"{FULLNAME}-proxy"))
    assert proxy["command"] == ["pd-proxy"]
    f = flags(proxy["args"])
    assert f["discovery"] == "dns"
    for role in ("prefill", "decode"):
        host, port = f[f"{role}-dns"].rsplit(":", 1)
        svc = service_for(r, role)
        assert svc["spec"]["clusterIP"] == "None", "discovery needs a headless Service"
        assert host == f"{svc['metadata']['name']}.{NAMESPACE}.svc.cluster.local"
        assert int(port) == svc_port(svc, "http")
        (pool,) = pods_selected(r, svc["spec"]["selector"])
        assert (
            pool["kind"] == "StatefulSet" and pool["spec"]["serviceName"] == svc["metadata"]["name"]
        )
        assert int(port) == container_port(container(pool), "http")

    meta = urlsplit(f["metaserver"])
    msvc = service_for(r, "metaserver")
    assert meta.hostname == msvc["metadata"]["name"] and meta.port == svc_port(msvc, "http")
    (mpods,) = pods_selected(r, msvc["spec"]["selector"])
    assert container_port(container(mpods), "http") == meta.port
    assert int(f["port"]) == container_port(proxy, "http")
    assert f["flow"] == SCENARIOS[name].get("proxy", {}).get("flow", "decode-first")


def test_wiring_proxy_cli_accepts_the_rendered_flags(
    scenario: tuple[str, Rendered], monkeypatch: pytest.MonkeyPatch
) -> None:
    """pd-proxy's own command line parses the rendered flags and environment."""
    name, r = scenario
    proxy = container(r.get("Deployment", f"{FULLNAME}-proxy"))
    env = resolve_env(proxy, secrets=fake_secrets(r), fields=fields("proxy-0"))
    for key in [k for k in os.environ if k.startswith("PD_PROXY_")]:
        monkeypatch.delenv(key)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    settings = load_proxy_settings(proxy["args"])
    assert settings.metaserver == f"http://{FULLNAME}-metaserver:8300"
    assert settings.host == "0.0.0.0" and settings.port == container_port(proxy, "http")
    values = SCENARIOS[name].get("proxy", {})
    kv = SCENARIOS[name].get("kvRouting", {}).get("enabled", False)  # test_kv_routing.py
    assert settings.prefill_policy == ("kv" if kv else values.get("prefillPolicy", "least_load"))
    assert settings.decode_policy == ("kv" if kv else values.get("decodePolicy", "least_load"))
    assert settings.share_load == kv and (settings.tokenizer is not None) == kv
    auth = SCENARIOS[name].get("auth", {})
    if not auth.get("enabled", True):
        assert settings.metaserver_token is None
    else:
        assert settings.metaserver_token is not None
        if auth.get("existingSecret"):  # roles mode: the proxy's own credential
            assert settings.metaserver_token.get_secret_value() == "user-proxy-token"
    # The engines' API key (issue 46; sec-design.md: the proxy's engine_api_key, env
    # PD_PROXY_ENGINE_API_KEY): the proxy sends the key the engines' VLLM_API_KEY holds.
    engine_key = r.secret_data(f"{FULLNAME}-auth")["engine-api-key"]
    assert settings.engine_api_key is not None
    assert settings.engine_api_key.get_secret_value() == engine_key
    if name == "auth-existing-secret":
        assert [k.get_secret_value() for k in settings.api_keys] == ["k1", "k2"]
        assert [k.get_secret_value() for k in settings.admin_keys] == ["a1"]
    else:
        assert settings.admin_keys == []  # /admin is off


# --- metaserver -----------------------------------------------------------------------------


def test_wiring_metaserver_settings_accept_the_rendered_flags(
    scenario: tuple[str, Rendered], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    name, r = scenario
    ms = container(r.get("Deployment", f"{FULLNAME}-metaserver"))
    assert ms["command"] == ["pd-metaserver"]
    secrets = fake_secrets(r)
    env = resolve_env(ms, secrets=secrets, fields=fields("ms-0"))
    env |= mount_credentials(r, secrets, tmp_path) or {}
    for key in [k for k in os.environ if k.startswith("PD_METASERVER_")]:
        monkeypatch.delenv(key)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    settings = load_metaserver_settings(ms["args"])
    assert settings.port == container_port(ms, "http")
    store = settings.store
    values = SCENARIOS[name]
    redis_values = values.get("redis", {})
    if redis_values.get("enabled", True):
        password = r.secret_data(f"{FULLNAME}-auth")["redis-password"]
        assert store == f"redis://pdgate:{password}@{FULLNAME}-redis:6379/0"
        redis = container(r.get("StatefulSet", f"{FULLNAME}-redis"))
        assert container_port(redis, "redis") == 6379
    elif redis_values.get("external", {}).get("url"):
        assert store == redis_values["external"]["url"]
    elif redis_values.get("external", {}).get("existingSecret"):
        assert store == "redis://:pw@kv:6379/0"
    else:
        assert store == "memory"
    auth = values.get("auth", {})
    assert (settings.token is not None) == auth.get("enabled", True)
    if auth.get("enabled", True):  # reads are protected by default (issue 46)
        assert settings.protect_reads == values.get("metaserver", {}).get("protectReads", True)
    roles = auth.get("enabled", True) and auth.get("mode", "roles") == "roles"
    assert (settings.credentials_file is not None) == roles
    if roles:
        assert settings.credentials_file is not None
        monkeypatch.setenv("KUBERNETES_SERVICE_HOST", "10.96.0.1")  # as the kubelet sets it
        access = Access.load(None, settings.credentials_file, False, settings.kube_reviewer)
        if auth.get("engineIdentity", "serviceAccountToken") == "serviceAccountToken":
            _check_pod_identities(r, secrets, access, settings.credentials_file)
        else:
            _check_pool_credentials(r, secrets, access)


def _check_pod_identities(
    r: Rendered, secrets: dict[str, dict[str, str]], access: Access, path: Path
) -> None:
    """Per-pod identity (issue 46): the file the metaserver loaded names, for each pool, the
    ServiceAccount its pods run under (their projected tokens are reviewed against it); the
    proxy's token is a proxy's."""
    import yaml

    entries = {e["name"]: e for e in yaml.safe_load(path.read_text())["credentials"]}
    for role in ("prefill", "decode"):
        spec = pod_spec(r.get("StatefulSet", f"{FULLNAME}-{role}"))
        entry = entries[f"{role}-pods"]
        assert entry["role"] == "engine" and entry["engine_role"] == role
        account = f"{NAMESPACE}:{spec['serviceAccountName']}"
        assert entry["kubernetes"] == {"service_account": account}
    proxy = container(r.get("Deployment", f"{FULLNAME}-proxy"))
    env = resolve_env(proxy, secrets=secrets, fields=fields("proxy-0"))
    assert resolved(access, f"Bearer {env['PD_PROXY_METASERVER_TOKEN']}").role is Role.PROXY


def _check_pool_credentials(
    r: Rendered, secrets: dict[str, dict[str, str]], access: Access
) -> None:
    """Each pool's pods, with the token their env reads, act as themselves and as no pod of
    the other pool; the proxy's token is a proxy's."""
    for role, other in (("prefill", "decode"), ("decode", "prefill")):
        w = r.get("StatefulSet", f"{FULLNAME}-{role}")
        pod = f"{FULLNAME}-{role}-0"
        env = resolve_env(container(w), secrets=secrets, fields=fields(pod))
        who = resolved(access, f"Bearer {env['PDGATE_METASERVER_TOKEN']}")
        assert who.role is Role.ENGINE and who.engine_role is not None
        assert who.engine_role.value == role
        assert who.covers(pod) and not who.covers(f"{FULLNAME}-{other}-0")
    proxy = container(r.get("Deployment", f"{FULLNAME}-proxy"))
    env = resolve_env(proxy, secrets=secrets, fields=fields("proxy-0"))
    assert resolved(access, f"Bearer {env['PD_PROXY_METASERVER_TOKEN']}").role is Role.PROXY


# --- labels, ports, secrets -----------------------------------------------------------------


def test_wiring_selectors_match_labels(scenario: tuple[str, Rendered]) -> None:
    _, r = scenario
    for w in r.workloads():
        sel = w["spec"]["selector"]["matchLabels"]
        assert matches(sel, w["spec"]["template"]["metadata"]["labels"]), w["metadata"]["name"]
        others = [o for o in r.workloads() if o is not w]
        assert not any(matches(sel, o["spec"]["template"]["metadata"]["labels"]) for o in others)
    for svc in r.of_kind("Service"):
        assert len(pods_selected(r, svc["spec"]["selector"])) == 1, svc["metadata"]["name"]
    for pdb in r.of_kind("PodDisruptionBudget"):
        assert len(pods_selected(r, pdb["spec"]["selector"]["matchLabels"])) == 1
    for hpa in r.of_kind("HorizontalPodAutoscaler"):
        ref = hpa["spec"]["scaleTargetRef"]
        assert r.has(ref["kind"], ref["name"])
    for np in r.of_kind("NetworkPolicy"):
        assert len(pods_selected(r, np["spec"]["podSelector"]["matchLabels"])) == 1
        for rule in np["spec"].get("ingress", []):
            for peer in rule.get("from", []):
                if "podSelector" in peer:
                    assert pods_selected(r, peer["podSelector"]["matchLabels"]), peer


def test_wiring_service_monitors_select_metrics_services(renders: dict[str, Rendered]) -> None:
    r = renders["observability"]
    for sm in r.of_kind("ServiceMonitor"):
        assert sm["metadata"]["labels"]["release"] == "kps"
        (svc,) = [
            s
            for s in r.of_kind("Service")
            if matches(sm["spec"]["selector"]["matchLabels"], s["metadata"]["labels"])
        ]
        ports = {p["name"] for p in svc["spec"]["ports"]}
        for ep in sm["spec"]["endpoints"]:
            assert ep["port"] in ports and ep["path"] == "/metrics"


def test_wiring_ports_agree(scenario: tuple[str, Rendered]) -> None:
    _, r = scenario
    for w, c in iter_containers(r):
        named = {p["name"]: p["containerPort"] for p in c.get("ports", [])}
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            spec = c.get(probe)
            if spec is None:
                continue
            for kind in ("httpGet", "tcpSocket"):
                if kind in spec:
                    assert spec[kind]["port"] in named, (w["metadata"]["name"], probe)
        if "--port" in " ".join(c.get("args", [])):
            for arg in c["args"]:
                if arg.startswith("--port="):
                    assert int(arg.split("=")[1]) == named["http"]
    for svc in r.of_kind("Service"):
        (w,) = pods_selected(r, svc["spec"]["selector"])
        cports = {
            p["name"]: p["containerPort"] for c in pod_spec(w)["containers"] for p in c["ports"]
        }
        for p in svc["spec"]["ports"]:
            target = p["targetPort"]
            assert target in cports or target in cports.values(), (svc["metadata"]["name"], p)
    # Readiness means different things per component.
    ms = container(r.get("Deployment", f"{FULLNAME}-metaserver"))
    assert ms["readinessProbe"]["httpGet"]["path"] == "/ready"
    proxy = container(r.get("Deployment", f"{FULLNAME}-proxy"))
    assert proxy["readinessProbe"]["httpGet"]["path"] == "/health"
    # The proxy's /health is 503 while a pool is empty: it must never restart the proxy.
    assert "httpGet" not in proxy["livenessProbe"] and "httpGet" not in proxy["startupProbe"]


def test_wiring_secrets_are_referenced_never_inlined(scenario: tuple[str, Rendered]) -> None:
    name, r = scenario
    rendered_secrets = {s["metadata"]["name"]: s for s in r.of_kind("Secret")}
    for w, c in iter_containers(r):
        for item in c.get("env", []):
            ref = item.get("valueFrom", {}).get("secretKeyRef")
            if ref:
                if ref["name"] in rendered_secrets:
                    assert ref["key"] in rendered_secrets[ref["name"]]["data"], ref
                else:
                    assert ref["name"] in USER_SECRETS, ref
            if any(t in item["name"] for t in ("TOKEN", "PASSWORD", "API_KEYS", "ADMIN_KEYS")):
                assert "value" not in item, (w["metadata"]["name"], item["name"])
    text = r.text()
    for secret in rendered_secrets.values():
        for value in r.secret_data(secret["metadata"]["name"]).values():
            assert value not in text, f"{name}: a Secret value appears in a manifest"
    if name == "auth-given-token":
        assert r.secret_data(f"{FULLNAME}-auth")["token"] == "s3cr3t-given-token"
        assert "s3cr3t-given-token" not in text


def test_wiring_token_reaches_every_component(scenario: tuple[str, Rendered]) -> None:
    """Single-token mode: proxy, metaserver and both pools read one and the same Secret key.
    Roles mode: one Secret, a key of its own for each (the metaserver's is the admin's); with
    per-pod identity (the default since issue 46) the engines read none: they present their
    pod's projected ServiceAccount token instead (test_secure_defaults.py)."""
    name, r = scenario
    auth = SCENARIOS[name].get("auth", {})
    roles = auth.get("mode", "roles") == "roles"
    per_pod = roles and auth.get("engineIdentity", "serviceAccountToken") == "serviceAccountToken"
    wanted = {
        f"{FULLNAME}-proxy": "PD_PROXY_METASERVER_TOKEN",
        f"{FULLNAME}-metaserver": "PD_METASERVER_TOKEN",
        f"{FULLNAME}-prefill": "PDGATE_METASERVER_TOKEN",
        f"{FULLNAME}-decode": "PDGATE_METASERVER_TOKEN",
    }
    refs = set()
    for wname, var in wanted.items():
        w = next(x for x in r.workloads() if x["metadata"]["name"] == wname)
        items = [e for e in container(w).get("env", []) if e["name"] == var]
        if not SCENARIOS[name].get("auth", {}).get("enabled", True) or (
            per_pod and w["kind"] == "StatefulSet"
        ):
            assert items == []
            continue
        (item,) = items
        ref = item["valueFrom"]["secretKeyRef"]
        refs.add((ref["name"], ref["key"]))
    assert len({secret for secret, _ in refs}) <= 1
    if roles and auth.get("enabled", True):
        assert len(refs) == (2 if per_pod else 4)
    else:
        assert len(refs) == min(len(refs), 1)


def test_wiring_pods_run_unprivileged_where_they_can(scenario: tuple[str, Rendered]) -> None:
    _, r = scenario
    for w in r.workloads():
        component = w["spec"]["template"]["metadata"]["labels"]["app.kubernetes.io/component"]
        spec = pod_spec(w)
        # Only the metaserver, with per-pod engine identity, gets its API token: it reviews
        # the engines' tokens and reads their pods (issue 46). Before, no pod had one.
        api = component == "metaserver" and r.has("ClusterRoleBinding", _delegation(r))
        assert spec["automountServiceAccountToken"] is api
        if component in ("proxy", "metaserver", "redis"):
            assert spec["securityContext"]["runAsNonRoot"] is True
            assert spec["securityContext"]["runAsUser"] != 0
            sc = container(w)["securityContext"]
            assert sc["allowPrivilegeEscalation"] is False and sc["readOnlyRootFilesystem"] is True


def _delegation(r: Rendered) -> str:
    found = [d["metadata"]["name"] for d in r.of_kind("ClusterRoleBinding")]
    return found[0] if found else ""
