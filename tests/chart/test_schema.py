"""values.schema.json and the chart's own checks reject bad values with a message naming them."""

from __future__ import annotations

import json
import re
from typing import Any

import helm_python as helm
import pytest
import yaml

from tests.chart.rendering import CHART_DIR, FULLNAME, SCENARIOS, render

BAD_VALUES: list[tuple[str, dict[str, Any], str]] = [
    ("negative prefill replicas", {"prefill": {"replicas": -1}}, "/prefill/replicas"),
    ("negative decode replicas", {"decode": {"replicas": -2}}, "/decode/replicas"),
    ("negative proxy replicas", {"proxy": {"replicas": -1}}, "/proxy/replicas"),
    ("unknown accelerator", {"accelerator": "tpu"}, "/accelerator"),
    ("zero tensor parallel", {"prefill": {"tensorParallelSize": 0}}, "/prefill/tensorParallelSize"),
    ("replicas as text", {"decode": {"replicas": "two"}}, "/decode/replicas"),
    ("unknown flow", {"proxy": {"flow": "prefill-last"}}, "/proxy/flow"),
    ("unknown policy", {"proxy": {"decodePolicy": "fastest"}}, "/proxy/decodePolicy"),
    ("misspelt key", {"proxy": {"replica": 3}}, "replica"),
    ("unknown top-level key", {"acelerator": "cpu"}, "acelerator"),
    ("port out of range", {"metaserver": {"port": 70000}}, "/metaserver/port"),
    ("bad protocol", {"connector": {"protocol": "infiniband"}}, "/connector/protocol"),
    (
        "token in connector config",
        {"connector": {"extraConfig": {"metaserver_token": "x"}}},
        "/connector/extraConfig",
    ),
    ("empty model", {"model": {"name": ""}}, "/model/name"),
    (
        "not a redis url",
        {"redis": {"enabled": False, "external": {"url": "http://x"}}},
        "/redis/external/url",
    ),
    ("unknown cache type", {"model": {"cache": {"type": "nfs"}}}, "/model/cache/type"),
    ("events port at the top", {"kvRouting": {"eventsPort": 65535}}, "/kvRouting/eventsPort"),
    (
        "unknown tokenizer source",
        {"kvRouting": {"tokenizer": {"source": "hub"}}},
        "/kvRouting/tokenizer/source",
    ),
    ("share load as text", {"proxy": {"shareLoad": "yes"}}, "/proxy/shareLoad"),
]


@pytest.mark.parametrize(("case", "values", "where"), BAD_VALUES, ids=[b[0] for b in BAD_VALUES])
def test_schema_rejects_bad_values(
    chart: helm.Chart, case: str, values: dict[str, Any], where: str
) -> None:
    with pytest.raises(helm.HelmValuesError) as err:
        chart.validate_schema(values)
    assert where in str(err.value), (case, str(err.value))
    # helm install/template run the same validation before rendering.
    with pytest.raises(helm.HelmValuesError):
        chart.render(values, name="rel", namespace="serving")


@pytest.mark.parametrize("name", sorted(SCENARIOS))
def test_schema_accepts_every_documented_value_set(chart: helm.Chart, name: str) -> None:
    chart.validate_schema(SCENARIOS[name])


def test_schema_accepts_the_default_values_file(chart: helm.Chart) -> None:
    defaults = yaml.safe_load((CHART_DIR / "values.yaml").read_text())
    chart.validate_schema(defaults)


def _leaf_paths(node: Any, prefix: str = "") -> list[str]:
    if isinstance(node, dict) and node:
        return [p for k, v in node.items() for p in _leaf_paths(v, f"{prefix}.{k}")]
    return [prefix]


def test_schema_describes_every_value(chart: helm.Chart) -> None:
    """Every key of values.yaml is in the schema (so additionalProperties=false is safe)."""
    schema = json.loads((CHART_DIR / "values.schema.json").read_text())
    defaults = yaml.safe_load((CHART_DIR / "values.yaml").read_text())

    def find(node: dict[str, Any], parts: list[str]) -> bool:
        for part in parts:
            props = node.get("properties", {})
            if part in props:
                node = props[part]
            elif isinstance(node.get("additionalProperties"), dict):
                node = node["additionalProperties"]
            elif node.get("type") == "object" and "properties" not in node:
                return True  # free-form map (labels, resources, extraConfig)
            else:
                return False
        return True

    missing = [p for p in _leaf_paths(defaults) if not find(schema, p.strip(".").split("."))]
    assert missing == []


def test_values_file_documents_every_value() -> None:
    """Each scalar key in values.yaml has a comment right above it, or sits inside a block
    (a map or list value) whose key has one."""
    lines = (CHART_DIR / "values.yaml").read_text().splitlines()

    def indent(line: str) -> int:
        return len(line) - len(line.lstrip(" -"))

    def commented(i: int) -> bool:
        j = i - 1
        while j >= 0 and not lines[j].strip():
            j -= 1
        return j >= 0 and lines[j].strip().startswith("#")

    def parent(i: int) -> int | None:
        for j in range(i - 1, -1, -1):
            s = lines[j]
            if s.strip() and not s.strip().startswith("#") and indent(s) < indent(lines[i]):
                return j
        return None

    undocumented = []
    for i, line in enumerate(lines):
        if not re.match(r"^\s*[A-Za-z][A-Za-z0-9_]*:", line) or line.rstrip().endswith(":"):
            continue  # not a key, or a section header whose children are checked
        k: int | None = i
        while k is not None and not commented(k):
            k = parent(k)
            if k is not None and lines[k].rstrip().endswith(":") and not commented(k):
                k = None  # reached an undocumented section header
        if k is None:
            undocumented.append(f"{i + 1}: {line.strip()}")
    assert undocumented == []


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ({"redis": {"enabled": False}, "metaserver": {"replicas": 2}}, "needs shared state"),
        ({"redis": {"external": {"url": "redis://kv:6379"}}}, "exclusive"),
        (
            {"redis": {"enabled": False, "external": {"url": "redis://a", "existingSecret": "s"}}},
            "only one of",
        ),
        (
            {"proxy": {"autoscaling": {"enabled": True, "minReplicas": 5, "maxReplicas": 2}}},
            "minReplicas",
        ),
        ({"model": {"cache": {"type": "existingClaim"}}}, "existingClaim is required"),
        (
            {"engine": {"terminationGracePeriodSeconds": 200, "drain": {"timeoutS": 300}}},
            "engine.terminationGracePeriodSeconds (200) must be at least engine.drain.timeoutS",
        ),
        (
            {"prefill": {"tensorParallelSize": 2}, "decode": {"tensorParallelSize": 3}},
            "prefill.tensorParallelSize 2 and decode.tensorParallelSize 3 cannot disaggregate",
        ),
        (
            {"model": {"kvHeads": 4}, "decode": {"tensorParallelSize": 8}, "accelerator": "cpu"},
            "",  # 8 ranks over 4 heads: replicated, fine (checked below: renders)
        ),
        (
            {"model": {"kvHeads": 6}, "decode": {"tensorParallelSize": 4}},
            "decode.tensorParallelSize 4 cannot split model.kvHeads 6",
        ),
    ],
)
def test_chart_rejects_inconsistent_values(values: dict[str, Any], message: str) -> None:
    if not message:
        render(values)  # a pairing that can push
        return
    with pytest.raises(helm.HelmError) as err:
        render(values)
    assert message in str(err.value)


def test_schema_knows_the_proxys_flows_and_policies() -> None:
    """The enums in the schema are exactly what pd-proxy accepts (empty: the proxy default)."""
    from proxy.config import Flow
    from proxy.policies import POLICIES

    schema = json.loads((CHART_DIR / "values.schema.json").read_text())["properties"]
    props = schema["proxy"]["properties"]
    assert set(props["flow"]["enum"]) == {f.value for f in Flow}
    kv = schema["kvRouting"]["properties"]
    for key in ("prefillPolicy", "decodePolicy"):
        assert set(props[key]["enum"]) == set(POLICIES) | {""}
        assert set(kv[key]["enum"]) == set(POLICIES)


def test_schema_takes_a_sentinel_url_for_external_redis() -> None:
    url = "redis+sentinel://s1:26379,s2:26379/pdgate/0"
    r = render({"redis": {"enabled": False, "external": {"url": url}}})
    ms = r.get("Deployment", f"{FULLNAME}-metaserver")
    env = {
        e["name"]: e.get("value") for e in ms["spec"]["template"]["spec"]["containers"][0]["env"]
    }
    assert env["PD_METASERVER_STORE"] == url
