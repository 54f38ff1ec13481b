"""Render charts/pdgate with Helm's own Go engine (helm_python) and query the result."""

from __future__ import annotations

import base64
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import helm_python as helm
import yaml

REPO = Path(__file__).resolve().parents[2]
CHART_DIR = REPO / "charts" / "pdgate"
RELEASE = "rel"
NAMESPACE = "serving"
FULLNAME = f"{RELEASE}-pdgate"

EXAMPLES_DIR = CHART_DIR / "examples"


def _example(name: str) -> dict[str, Any]:
    values: dict[str, Any] = yaml.safe_load((EXAMPLES_DIR / f"{name}.yaml").read_text())
    return values


# Value sets the tests render; each is also linted and validated against Kubernetes schemas.
# The accelerator ones are the example files users install with `-f`.
SCENARIOS: dict[str, dict[str, Any]] = {
    "cpu-1p1d-memory": _example("cpu-1p1d"),
    "nvidia-4p2d-rdma": _example("nvidia-4p2d"),
    "ascend-2p1d-tp": _example("ascend-2p1d"),
    "defaults": {},
    "external-redis-url": {"redis": {"enabled": False, "external": {"url": "redis://kv:6379/2"}}},
    "external-redis-secret": {
        "redis": {"enabled": False, "external": {"existingSecret": "my-redis"}},
    },
    "auth-existing-secret": {
        "auth": {"existingSecret": "pd-token", "existingSecretKey": "tok"},
        "proxy": {
            "apiKeys": {"existingSecret": "client-keys"},
            "adminKeys": {"existingSecret": "admin-keys"},
        },
        "metaserver": {"protectReads": True},
    },
    "auth-given-token": {"auth": {"token": "s3cr3t-given-token"}},
    "auth-single-token": {"auth": {"mode": "single"}},
    # roles mode with today's per-pool engine tokens instead of per-pod ServiceAccount tokens
    "auth-pool-tokens": {"auth": {"engineIdentity": "poolToken"}},
    "observability": {
        "metrics": {
            "serviceMonitor": {"enabled": True, "labels": {"release": "kps"}},
            "prometheusRule": {"enabled": True, "labels": {"release": "kps"}},
            "grafanaDashboard": {"enabled": True},
        },
        "networkPolicy": {
            "enabled": True,
            "metricsNamespaceSelector": {
                "matchLabels": {"kubernetes.io/metadata.name": "monitoring"}
            },
        },
        "proxy": {"autoscaling": {"enabled": True}, "service": {"type": "LoadBalancer"}},
        "redis": {"persistence": {"enabled": True}},
    },
    "concurrent-flow": {
        "proxy": {"flow": "concurrent", "prefillPolicy": "round_robin", "decodePolicy": "prefix"},
    },
    "fail-on-lost-kv": {"connector": {"kvLoadFailurePolicy": "fail", "kvLoadTimeoutS": 30}},
    "long-drain": {
        "engine": {"terminationGracePeriodSeconds": 960, "drain": {"settleS": 5, "timeoutS": 900}}
    },
    # KV-event routing; the proxy reads the tokenizer from the engines' shared model cache
    "kv-routing": {
        "kvRouting": {"enabled": True},
        "model": {"cache": {"type": "existingClaim", "existingClaim": "models"}},
    },
}

# Secrets the scenarios expect to exist already (created by the user, not by the chart).
USER_SECRETS = {"pd-token", "client-keys", "admin-keys", "my-redis", "hf-token"}


def load_chart() -> helm.Chart:
    return helm.Chart.load(str(CHART_DIR))


@dataclass
class Rendered:
    """The manifests of one render, parsed; NOTES.txt kept apart."""

    docs: list[dict[str, Any]]
    notes: str
    files: dict[str, str] = field(default_factory=dict)

    def of_kind(self, kind: str) -> list[dict[str, Any]]:
        return [d for d in self.docs if d["kind"] == kind]

    def get(self, kind: str, name: str) -> dict[str, Any]:
        found = [d for d in self.of_kind(kind) if d["metadata"]["name"] == name]
        assert len(found) == 1, f"expected one {kind}/{name}, found {len(found)}"
        return found[0]

    def has(self, kind: str, name: str) -> bool:
        return any(d["metadata"]["name"] == name for d in self.of_kind(kind))

    def workloads(self) -> list[dict[str, Any]]:
        return [d for d in self.docs if d["kind"] in ("Deployment", "StatefulSet")]

    def secret_data(self, name: str) -> dict[str, str]:
        data = self.get("Secret", name).get("data", {})
        return {k: base64.b64decode(v).decode() for k, v in data.items()}

    def text(self) -> str:
        """Every manifest but the chart's Secrets, as YAML (to search for leaked values)."""
        return "\n".join(yaml.safe_dump(d) for d in self.docs if d["kind"] != "Secret")


def render(
    values: dict[str, Any] | None = None,
    *,
    chart: helm.Chart | None = None,
    name: str = RELEASE,
    namespace: str = NAMESPACE,
) -> Rendered:
    chart = chart or load_chart()
    files = chart.render(values or {}, name=name, namespace=namespace, is_install=True)
    return parse(files)


def parse(files: dict[str, str]) -> Rendered:
    docs: list[dict[str, Any]] = []
    notes = ""
    for path, text in sorted(files.items()):
        if path.endswith("NOTES.txt"):
            notes = text
            continue
        for doc in yaml.safe_load_all(text):
            if doc:
                docs.append(doc)
    return Rendered(docs=docs, notes=notes, files=files)


# --- pods -----------------------------------------------------------------------------------


def pod_spec(workload: dict[str, Any]) -> dict[str, Any]:
    spec: dict[str, Any] = workload["spec"]["template"]["spec"]
    return spec


def container(workload: dict[str, Any], name: str | None = None) -> dict[str, Any]:
    containers: list[dict[str, Any]] = pod_spec(workload)["containers"]
    if name is None:
        assert len(containers) == 1
        return containers[0]
    return next(c for c in containers if c["name"] == name)


def flags(args: list[str]) -> dict[str, str]:
    """``--name=value`` arguments as {name: value} (the last occurrence wins)."""
    out: dict[str, str] = {}
    for arg in args:
        if arg.startswith("--") and "=" in arg:
            key, value = arg[2:].split("=", 1)
            out[key] = value
    return out


def arg_after(args: list[str], flag: str) -> str:
    i = args.index(flag)
    return args[i + 1]


_VAR = re.compile(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)")


def var_refs(text: str) -> set[str]:
    return set(_VAR.findall(text))


def expand(text: str, env: dict[str, str]) -> str:
    """Kubernetes' $(VAR) expansion in args and env values (unknown references stay as is)."""
    return _VAR.sub(lambda m: env.get(m.group(1), m.group(0)), text)


def resolve_env(
    c: dict[str, Any],
    *,
    secrets: dict[str, dict[str, str]],
    fields: dict[str, str],
) -> dict[str, str]:
    """The container's environment as the kubelet builds it: secretKeyRef and fieldRef looked
    up, $(VAR) expanded against the variables defined before (in list order)."""
    env: dict[str, str] = {}
    for item in c.get("env", []):
        if "value" in item:
            env[item["name"]] = expand(str(item["value"]), env)
        elif "secretKeyRef" in item.get("valueFrom", {}):
            ref = item["valueFrom"]["secretKeyRef"]
            env[item["name"]] = secrets[ref["name"]][ref["key"]]
        elif "fieldRef" in item.get("valueFrom", {}):
            env[item["name"]] = fields[item["valueFrom"]["fieldRef"]["fieldPath"]]
        else:
            raise AssertionError(f"unsupported env source: {item}")
    return env


def iter_containers(r: Rendered) -> Iterator[tuple[dict[str, Any], dict[str, Any]]]:
    for w in r.workloads():
        for c in pod_spec(w)["containers"]:
            yield w, c
