"""Helpers of the wiring tests: selectors, Services, ports, and the kubelet's view of env."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tests.chart.rendering import FULLNAME, NAMESPACE, Rendered, container


def mount_credentials(
    r: Rendered, secrets: dict[str, dict[str, str]], root: Path
) -> dict[str, str] | None:
    """Roles mode: the metaserver pod's credential volumes as the kubelet mounts them (the
    ConfigMap's file and the Secret's items, under ``root`` instead of ``/``). Returns the
    env to override (PD_METASERVER_CREDENTIALS_FILE), or None in single-token mode."""
    ms = r.get("Deployment", f"{FULLNAME}-metaserver")
    volumes = {v["name"]: v for v in ms["spec"]["template"]["spec"]["volumes"]}
    mounts = {m["name"]: m["mountPath"] for m in container(ms)["volumeMounts"]}
    if "access" not in volumes:
        return None
    config = r.get("ConfigMap", volumes["access"]["configMap"]["name"])
    secret = volumes["credentials"]["secret"]
    auth_dir = root / mounts["credentials"].lstrip("/")
    auth_dir.mkdir(parents=True)
    for item in secret["items"]:
        (auth_dir / item["path"]).write_text(secrets[secret["secretName"]][item["key"]])
    access_dir = root / mounts["access"].lstrip("/")
    access_dir.mkdir(parents=True)
    for name, text in config["data"].items():
        (access_dir / name).write_text(text.replace(mounts["credentials"], str(auth_dir)))
    env = {e["name"]: e.get("value") for e in container(ms)["env"]}
    path = env["PD_METASERVER_CREDENTIALS_FILE"]
    assert path is not None and path.startswith(mounts["access"] + "/")
    return {"PD_METASERVER_CREDENTIALS_FILE": str(root / path.lstrip("/"))}


def matches(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return all(labels.get(k) == v for k, v in selector.items())


def pods_selected(r: Rendered, selector: dict[str, str]) -> list[dict[str, Any]]:
    return [
        w for w in r.workloads() if matches(selector, w["spec"]["template"]["metadata"]["labels"])
    ]


def fake_secrets(r: Rendered) -> dict[str, dict[str, str]]:
    """What the kubelet would read: the chart's Secrets, plus stand-ins for the user's."""
    secrets = {
        s["metadata"]["name"]: r.secret_data(s["metadata"]["name"]) for s in r.of_kind("Secret")
    }
    secrets["pd-token"] = {"tok": "user-token"} | {
        f"{part}-token": f"user-{part}-token" for part in ("proxy", "prefill", "decode")
    }
    secrets["client-keys"] = {"api-keys": "k1,k2"}
    secrets["admin-keys"] = {"admin-keys": "a1"}
    secrets["my-redis"] = {"url": "redis://:pw@kv:6379/0"}
    secrets["hf-token"] = {"token": "hf-user-token"}
    return secrets


def fields(pod: str) -> dict[str, str]:
    return {"metadata.name": pod, "metadata.namespace": NAMESPACE, "status.podIP": "10.1.2.3"}


def service_for(r: Rendered, component: str) -> dict[str, Any]:
    found = [
        s
        for s in r.of_kind("Service")
        if s["spec"]["selector"].get("app.kubernetes.io/component") == component
    ]
    assert len(found) == 1, component
    return found[0]


def svc_port(svc: dict[str, Any], name: str) -> int:
    port: int = next(p["port"] for p in svc["spec"]["ports"] if p["name"] == name)
    return port


def container_port(c: dict[str, Any], name: str) -> int:
    port: int = next(p["containerPort"] for p in c["ports"] if p["name"] == name)
    return port


def mount_engine_files(
    pod: dict[str, Any], c: dict[str, Any], secrets: dict[str, dict[str, str]], root: Path
) -> dict[str, str]:
    """The files a container's Secret and projected ServiceAccount-token volumes hold, as the
    kubelet would mount them, written under ``root`` instead of ``/``. Returns {mount path in
    the container: the directory here}, for ``rebase``."""
    volumes = {v["name"]: v for v in pod["volumes"]}
    mapped: dict[str, str] = {}
    for m in c.get("volumeMounts", []):
        volume = volumes.get(m["name"], {})  # a volumeClaimTemplate's claim: none here
        files: dict[str, str] = {}
        if "secret" in volume:
            source = secrets[volume["secret"]["secretName"]]
            items = volume["secret"].get("items") or [{"key": k, "path": k} for k in source]
            files = {i["path"]: source[i["key"]] for i in items}
        elif "projected" in volume:
            for s in volume["projected"]["sources"]:
                if "serviceAccountToken" in s:
                    files[s["serviceAccountToken"]["path"]] = "a-projected-service-account-jwt"
        else:
            continue
        here = root / m["mountPath"].lstrip("/")
        here.mkdir(parents=True, exist_ok=True)
        for name, text in files.items():
            (here / name).write_text(text)
        mapped[m["mountPath"]] = str(here)
    return mapped


def rebase(text: str, mapped: dict[str, str]) -> str:
    """``text`` with the container's mount paths replaced by their directories here."""
    for inside, here in sorted(mapped.items(), key=lambda kv: -len(kv[0])):
        text = text.replace(inside + "/", here + "/")
    return text


MONITORING = "monitoring-namespace"  # a pod the metrics namespace selector admits


def admits(r: Rendered, policy: dict[str, Any], source: str, port: int, protocol: str) -> bool:
    """Does the NetworkPolicy let a pod of component ``source`` (or ``MONITORING``) open
    ``port``/``protocol`` on the pods it selects? Named ports resolve against those pods'
    containers; a rule without ``from`` or ``ports`` admits every source or port."""
    (target,) = pods_selected(r, policy["spec"]["podSelector"]["matchLabels"])
    named = {
        p["name"]: p["containerPort"]
        for c in target["spec"]["template"]["spec"]["containers"]
        for p in c.get("ports", [])
    }

    def from_source(peer: dict[str, Any]) -> bool:
        if "namespaceSelector" in peer:
            return source == MONITORING
        return any(
            w["spec"]["template"]["metadata"]["labels"]["app.kubernetes.io/component"] == source
            for w in pods_selected(r, peer["podSelector"]["matchLabels"])
        )

    def on_port(entry: dict[str, Any]) -> bool:
        if entry.get("protocol", "TCP") != protocol:
            return False
        if "port" not in entry:
            return True
        first = entry["port"] if isinstance(entry["port"], int) else named.get(entry["port"])
        if first is None:
            return False
        return first <= port <= entry.get("endPort", first)

    for rule in policy["spec"].get("ingress", []):
        if "from" in rule and not any(from_source(p) for p in rule["from"]):
            continue
        if "ports" not in rule or any(on_port(e) for e in rule["ports"]):
            return True
    return False
