"""The chart renders, lints clean and every manifest is valid Kubernetes, for every value set."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import helm_python as helm
import kubernetes_validate
import pytest
from kubernetes_validate.utils import SchemaNotFoundError

from tests.chart.rendering import CHART_DIR, FULLNAME, NAMESPACE, SCENARIOS, Rendered

# The newest Kubernetes the installed kubernetes-validate knows, and the oldest the chart claims
# to support (Chart.yaml kubeVersion).
KUBE_VERSION = kubernetes_validate.utils.latest_version()
OLDEST_SUPPORTED = "1.27.0"
CRD_KINDS = {
    ("monitoring.coreos.com/v1", "ServiceMonitor"),
    ("monitoring.coreos.com/v1", "PrometheusRule"),
}


@pytest.mark.parametrize("name", sorted(SCENARIOS))
def test_chart_lint_is_clean(name: str) -> None:
    assert f">={OLDEST_SUPPORTED}" in (CHART_DIR / "Chart.yaml").read_text()
    report = helm.lint(CHART_DIR, SCENARIOS[name], strict=True, kube_version=f"v{KUBE_VERSION}")
    problems = [m for m in report["messages"] if m["severity"] >= 2]
    assert report["errors"] == [] and problems == [], report


def test_chart_lint_reports_a_broken_template(tmp_path: Any) -> None:
    """The lint check itself can fail: a chart with a template error is reported."""
    import shutil

    broken = tmp_path / "pdgate"
    shutil.copytree(CHART_DIR, broken)
    (broken / "templates" / "broken.yaml").write_text("{{ .Values.nope.deeper }}\n")
    report = helm.lint(broken, None, strict=True)
    assert report["errors"] or any(m["severity"] == 3 for m in report["messages"])


@pytest.mark.parametrize("kube", [KUBE_VERSION, OLDEST_SUPPORTED])
def test_render_every_manifest_validates_strictly(
    scenario: tuple[str, Rendered], kube: str
) -> None:
    name, r = scenario
    assert r.docs, name
    for doc in r.docs:
        if (doc["apiVersion"], doc["kind"]) in CRD_KINDS:
            continue  # no built-in schema; checked by test_wiring_service_monitors_* and
            # test_dashboard's test_alert_rules_*
        try:
            kubernetes_validate.validate(doc, kube, strict=True)
        except SchemaNotFoundError:
            pytest.fail(f"{name}: {doc['kind']} {doc['apiVersion']} is not a Kubernetes type")


def test_render_validation_catches_an_unknown_field(renders: dict[str, Rendered]) -> None:
    """Strict validation is really strict: a misspelt field in a rendered Deployment fails."""
    doc = renders["defaults"].get("Deployment", f"{FULLNAME}-proxy")
    bad = {**doc, "spec": {**doc["spec"], "replica": 3}}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(bad, KUBE_VERSION, strict=True)


CLUSTER_SCOPED = {"ClusterRoleBinding"}  # the metaserver's TokenReview right (issue 46)


def test_render_objects_live_in_the_release_namespace(scenario: tuple[str, Rendered]) -> None:
    _, r = scenario
    for doc in r.docs:
        if doc["kind"] in CLUSTER_SCOPED:
            assert "namespace" not in doc["metadata"], doc["metadata"]
            assert NAMESPACE in doc["metadata"]["name"]  # one per release and namespace
            continue
        assert doc["metadata"]["namespace"] == NAMESPACE, doc["metadata"]


def test_render_names_are_unique_and_dns_safe(scenario: tuple[str, Rendered]) -> None:
    _, r = scenario
    keys = [(d["kind"], d["metadata"]["name"]) for d in r.docs]
    assert len(keys) == len(set(keys))
    for _, n in keys:
        assert len(n) <= 63 and n == n.lower(), n


def test_render_components_per_value_set(renders: dict[str, Rendered]) -> None:
    base = renders["defaults"]
    for kind, suffix in [
        ("Deployment", "proxy"),
        ("Deployment", "metaserver"),
        ("StatefulSet", "redis"),
        ("StatefulSet", "prefill"),
        ("StatefulSet", "decode"),
        ("Secret", "auth"),
        ("PodDisruptionBudget", "proxy"),
        ("PodDisruptionBudget", "metaserver"),
    ]:
        assert base.has(kind, f"{FULLNAME}-{suffix}"), (kind, suffix)
    assert not base.of_kind("HorizontalPodAutoscaler")
    assert not base.of_kind("ServiceMonitor")
    # NetworkPolicies are on by default: engines' KV ports (Mooncake cannot authenticate a
    # write) admit the release's engines only
    assert {d["metadata"]["name"] for d in base.of_kind("NetworkPolicy")} == {
        f"{FULLNAME}-{c}" for c in ("proxy", "metaserver", "redis", "prefill", "decode")
    }
    # Per-pod engine identity (issue 46): the metaserver's Role (get pods) and its binding to
    # the built-in system:auth-delegator; no ClusterRole of the chart's own. Before, no RBAC.
    assert {d["metadata"]["name"] for d in base.of_kind("Role")} == {f"{FULLNAME}-metaserver"}
    assert len(base.of_kind("ClusterRoleBinding")) == 1 and not base.of_kind("ClusterRole")
    assert not renders["auth-pool-tokens"].of_kind("Role")

    for ext in ("external-redis-url", "external-redis-secret", "cpu-1p1d-memory"):
        assert not renders[ext].has("StatefulSet", f"{FULLNAME}-redis"), ext
        assert not renders[ext].has("Service", f"{FULLNAME}-redis"), ext
    # No token and no Redis password: the chart's Secret holds only the side channel's and the
    # engines' generated keys (issue 46; before, no Secret was created at all).
    (secret,) = renders["cpu-1p1d-memory"].of_kind("Secret")
    assert set(secret["data"]) == {"side-channel-key", "engine-api-key"}
    assert not renders["auth-existing-secret"].has("Secret", "pd-token")

    obs = renders["observability"]
    assert {d["metadata"]["name"] for d in obs.of_kind("ServiceMonitor")} == {
        f"{FULLNAME}-proxy",
        f"{FULLNAME}-metaserver",
        f"{FULLNAME}-prefill",
        f"{FULLNAME}-decode",
    }
    assert obs.has("HorizontalPodAutoscaler", f"{FULLNAME}-proxy")
    assert "replicas" not in obs.get("Deployment", f"{FULLNAME}-proxy")["spec"]
    assert len(obs.of_kind("NetworkPolicy")) == 5
    redis = obs.get("StatefulSet", f"{FULLNAME}-redis")
    assert redis["spec"]["volumeClaimTemplates"][0]["metadata"]["name"] == "data"


def test_render_pool_sizes_follow_values(renders: dict[str, Rendered]) -> None:
    for name, p, d in [("nvidia-4p2d-rdma", 4, 2), ("ascend-2p1d-tp", 2, 1), ("defaults", 1, 1)]:
        r = renders[name]
        assert r.get("StatefulSet", f"{FULLNAME}-prefill")["spec"]["replicas"] == p
        assert r.get("StatefulSet", f"{FULLNAME}-decode")["spec"]["replicas"] == d


def test_render_grafana_dashboard_is_json_over_proxy_metrics(
    renders: dict[str, Rendered],
) -> None:
    import json

    cm = renders["observability"].get("ConfigMap", f"{FULLNAME}-dashboard")
    assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
    dash = json.loads(cm["data"]["pdgate.json"])
    exprs = " ".join(t["expr"] for p in dash["panels"] for t in p["targets"])
    for metric in (
        "pd_prefill_seconds_bucket",
        "pd_binding_wait_seconds_bucket",
        "pd_decode_ttft_seconds_bucket",
        "pd_decision_total",
        "pd_instance_healthy",
    ):
        assert metric in exprs, metric


def test_render_notes_explain_access(renders: dict[str, Rendered]) -> None:
    notes = renders["defaults"].notes
    assert f"port-forward svc/{FULLNAME}-proxy" in notes
    assert f"port-forward svc/{FULLNAME}-metaserver" in notes
    assert "$META/v1/bindings" in notes and "$META/v1/instances" in notes
    assert f"secret {FULLNAME}-auth" in notes
    lb = renders["observability"].notes
    assert "loadBalancer.ingress" in lb
    memory = renders["cpu-1p1d-memory"].notes
    assert "keeps bindings in memory" in memory and "Authorization" not in memory


def test_chart_packages_and_the_archive_renders_the_same(tmp_path: Any) -> None:
    chart = helm.Chart.load(CHART_DIR)
    archive = chart.save(tmp_path)
    packed = helm.Chart.load_archive(Path(archive).read_bytes())
    assert packed.name == "pdgate" and packed.version == chart.metadata["version"]
    names = {f["name"] for f in packed.files}
    assert "files/grafana-dashboard.json" in names
    values = {**SCENARIOS["observability"], "auth": {"token": "fixed"}}
    same = {
        k: v
        for k, v in chart.render(values, name="rel", namespace=NAMESPACE).items()
        if not k.endswith("secret.yaml")  # the Redis password is random per render
    }
    again = packed.render(values, name="rel", namespace=NAMESPACE)
    for path, text in same.items():
        assert again[path] == text, path


def test_render_network_policies_can_be_turned_off() -> None:
    from tests.chart.rendering import render

    assert not render({"networkPolicy": {"enabled": False}}).of_kind("NetworkPolicy")
