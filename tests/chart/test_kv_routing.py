"""``kvRouting``: the engines publish vLLM's KV cache events on declared ports, the metaserver
follows them (and is the only outside peer the NetworkPolicy lets reach them), the proxy runs the
kv policy with the model's tokenizer from the engines' cache; combinations that cannot work
are refused at render time."""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import helm_python as helm
import pytest
from vllm.config import KVEventsConfig

from connector.kv_events import kv_events_of
from launch.plan import kv_events_config
from metaserver.cli import load_settings as load_metaserver_settings
from proxy.cli import load_settings as load_proxy_settings
from tests.chart.rendering import (
    FULLNAME,
    REPO,
    SCENARIOS,
    Rendered,
    arg_after,
    container,
    pod_spec,
    render,
    resolve_env,
)
from tests.chart.wiring import admits, container_port, fake_secrets, fields, pods_selected

VALUES: dict[str, Any] = SCENARIOS["kv-routing"]
KV_FLAGS = ("--kv-events-config", "--kv-events", "--tokenizer", "--share-load")


def _with(**overrides: Any) -> dict[str, Any]:
    """VALUES with top-level sections merged one level deep."""
    values = copy.deepcopy(VALUES)
    for key, value in overrides.items():
        values[key] = {**values.get(key, {}), **value}
    return values


def _proxy(r: Rendered) -> dict[str, Any]:
    return r.get("Deployment", f"{FULLNAME}-proxy")


# --- engines --------------------------------------------------------------------------------


@pytest.mark.parametrize("port", [5557, 7100])
@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_kv_routing_engines_publish_on_their_declared_ports(
    chart: helm.Chart, role: str, port: int
) -> None:
    r = render(_with(kvRouting={"eventsPort": port}), chart=chart)
    c = container(r.get("StatefulSet", f"{FULLNAME}-{role}"))
    cfg = json.loads(arg_after(c["args"], "--kv-events-config"))
    assert cfg == json.loads(kv_events_config(port))  # what pd-launch --kv-routing passes
    events = KVEventsConfig(**cfg)  # vLLM's own validation of the flag's value
    # What the connector registers for the metaserver to follow: the pod's declared ports.
    vllm_config = SimpleNamespace(
        kv_events_config=events,
        cache_config=SimpleNamespace(
            enable_prefix_caching=True, block_size=16, prefix_caching_hash_algo="sha256"
        ),
        parallel_config=SimpleNamespace(data_parallel_rank=0),
    )
    registered = kv_events_of(vllm_config)  # type: ignore[arg-type]
    assert registered is not None
    assert registered.port == container_port(c, "kv-events") == port
    assert registered.replay_port == container_port(c, "kv-replay") == port + 1


# --- metaserver and proxy -------------------------------------------------------------------


def test_kv_routing_metaserver_follows_the_events(renders: dict[str, Rendered]) -> None:
    ms = container(renders["kv-routing"].get("Deployment", f"{FULLNAME}-metaserver"))
    assert load_metaserver_settings(ms["args"]).kv_events is True


def test_kv_routing_proxy_runs_the_kv_policy_on_the_engines_cache(
    renders: dict[str, Rendered],
) -> None:
    r = renders["kv-routing"]
    proxy = _proxy(r)
    c = container(proxy)
    settings = load_proxy_settings(c["args"])
    assert settings.prefill_policy == settings.decode_policy == "kv"
    assert settings.tokenizer == "Qwen/Qwen2.5-0.5B-Instruct"  # model.name, as engines load it
    assert settings.share_load is True  # proxy.replicas 2 (default)
    env = resolve_env(c, secrets=fake_secrets(r), fields=fields("proxy-0"))
    assert env["HF_HOME"] == "/models" and env["HF_HUB_OFFLINE"] == "1"
    spec = pod_spec(proxy)
    (volume,) = [v for v in spec["volumes"] if v["name"] == "model-cache"]
    assert volume["persistentVolumeClaim"] == {"claimName": "models", "readOnly": True}
    (wait,) = spec["initContainers"]
    for ctr in (c, wait):
        (mount,) = [m for m in ctr["volumeMounts"] if m["name"] == "model-cache"]
        assert mount == {"name": "model-cache", "mountPath": "/models", "readOnly": True}
        assert ctr["securityContext"]["readOnlyRootFilesystem"] is True
    assert wait["image"] == c["image"] and wait["command"][-1] == settings.tokenizer
    engine = container(r.get("StatefulSet", f"{FULLNAME}-decode"))
    assert {"name": "HF_HOME", "value": "/models"} in engine["env"]


@pytest.mark.parametrize(
    ("proxy", "kv", "shared"),
    [
        ({"replicas": 1}, True, False),
        ({"replicas": 1, "autoscaling": {"enabled": True}}, True, True),
        ({"replicas": 1, "workers": 2}, True, True),
        ({"replicas": 3, "shareLoad": False}, True, False),
        ({"replicas": 3}, False, False),  # "auto" without kvRouting: as before
        ({"replicas": 1, "shareLoad": True}, False, True),
    ],
)
def test_kv_routing_share_load_follows_the_proxy_processes(
    chart: helm.Chart, proxy: dict[str, Any], kv: bool, shared: bool
) -> None:
    values = _with(proxy=proxy, kvRouting={"enabled": kv})
    args = container(_proxy(render(values, chart=chart)))["args"]
    assert load_proxy_settings(args).share_load is shared


def test_kv_routing_tokenizer_from_a_volume_of_its_own(chart: helm.Chart) -> None:
    volume = {"persistentVolumeClaim": {"claimName": "tokenizers"}}
    tokenizer: dict[str, Any] = {"source": "volume", "volume": volume}
    values = {"kvRouting": {"enabled": True, "tokenizer": tokenizer}}
    r = render(values, chart=chart)
    proxy = _proxy(r)
    c = container(proxy)
    assert load_proxy_settings(c["args"]).tokenizer == "/tokenizer"
    assert {"name": "tokenizer", "mountPath": "/tokenizer", "readOnly": True} in c["volumeMounts"]
    assert {"name": "tokenizer", **volume} in pod_spec(proxy)["volumes"]
    assert "initContainers" not in pod_spec(proxy)
    assert not any(e["name"].startswith("HF_") for e in c.get("env", []))
    tokenizer["path"] = "/tokenizer/qwen"
    assert "--tokenizer=/tokenizer/qwen" in container(_proxy(render(values, chart=chart)))["args"]


def test_kv_routing_tokenizer_from_a_host_path_cache(chart: helm.Chart) -> None:
    cache = {"type": "hostPath", "hostPath": "/srv/models", "mountPath": "/weights"}
    r = render(_with(model={"name": "/weights/qwen", "cache": cache}), chart=chart)
    proxy = _proxy(r)
    (volume,) = [v for v in pod_spec(proxy)["volumes"] if v["name"] == "model-cache"]
    assert volume["hostPath"] == {"path": "/srv/models", "type": "Directory"}  # never created
    assert "--tokenizer=/weights/qwen" in container(proxy)["args"]


# --- off: nothing changes -------------------------------------------------------------------


def test_kv_routing_off_renders_nothing_of_it(scenario: tuple[str, Rendered]) -> None:
    name, r = scenario
    if name == "kv-routing":
        return
    for w in r.workloads():
        spec = pod_spec(w)
        for c in spec["containers"]:
            assert not [a for a in c.get("args", []) if a.split("=")[0] in KV_FLAGS], name
            assert not [p for p in c.get("ports", []) if p["name"].startswith("kv-")], name
            assert not [e for e in c.get("env", []) if e["name"] == "HF_HUB_OFFLINE"], name
        assert "initContainers" not in spec
    for np in r.of_kind("NetworkPolicy"):
        ports = [p.get("port") for rule in np["spec"]["ingress"] for p in rule.get("ports", [])]
        assert not [p for p in ports if str(p).startswith("kv-")], name


def test_kv_routing_off_ignores_its_other_values(chart: helm.Chart) -> None:
    off = {
        "eventsPort": 6000,
        "prefillPolicy": "least_load",
        "tokenizer": {"source": "volume", "path": "/x"},
    }
    plain = [d for d in render({}, chart=chart).docs if d["kind"] != "Secret"]
    ignored = [d for d in render({"kvRouting": off}, chart=chart).docs if d["kind"] != "Secret"]
    assert ignored == plain


# --- NetworkPolicy --------------------------------------------------------------------------


def _reach(r: Rendered, role: str) -> dict[str, set[str] | None]:
    """Per component, the named ports of `role`'s pods its pods may open (None: every port)."""
    policy = r.get("NetworkPolicy", f"{FULLNAME}-{role}")
    reach: dict[str, set[str] | None] = {}
    for rule in policy["spec"]["ingress"]:
        ports = (
            {str(p.get("port", p["protocol"])) for p in rule["ports"]} if "ports" in rule else None
        )
        for peer in rule["from"]:
            for w in pods_selected(r, peer["podSelector"]["matchLabels"]):
                component = w["spec"]["template"]["metadata"]["labels"][
                    "app.kubernetes.io/component"
                ]
                known = reach.get(component, set())
                reach[component] = None if ports is None or known is None else known | ports
    return reach


@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_kv_routing_event_ports_admit_the_metaserver_not_the_proxy(
    renders: dict[str, Rendered], role: str
) -> None:
    r = renders["kv-routing"]
    reach = _reach(r, role)
    assert reach["metaserver"] == {"kv-events", "kv-replay"}
    assert reach["proxy"] == {"http"}
    assert "redis" not in reach
    c = container(r.get("StatefulSet", f"{FULLNAME}-{role}"))
    assert {"kv-events", "kv-replay"} <= {p["name"] for p in c["ports"]}
    # The pools' own rule (Mooncake picks its ports at run time) admits every port but these
    # and vLLM's HTTP (issue 46; before, it was not port-limited and peers read the events).
    policy = r.get("NetworkPolicy", f"{FULLNAME}-{role}")
    named = {p["name"]: p["containerPort"] for p in c["ports"]}
    for peer in ("prefill", "decode"):
        for port in ("kv-events", "kv-replay", "http"):
            assert not admits(r, policy, peer, named[port], "TCP"), (peer, port)
        assert admits(r, policy, peer, named["side-0"], "TCP")


# --- refused --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("values", "message"),
    [
        (_with(connector={"kind": "vllm-ascend"}), "kvRouting needs pdgate's connector"),
        (
            _with(connector={"name": "NixlConnector", "modulePath": ""}),
            "connector.name NixlConnector does not",
        ),
        ({"kvRouting": {"enabled": True}}, "needs a shared one (model.cache.type existingClaim"),
        (
            _with(model={"cache": {"type": "pvc"}}),
            "model.cache.type existingClaim or hostPath), not pvc",
        ),
        (
            _with(kvRouting={"tokenizer": {"source": "volume"}}),
            "needs kvRouting.tokenizer.volume",
        ),
        ({"proxy": {"decodePolicy": "kv"}}, "set kvRouting.enabled=true"),
        (
            _with(proxy={"prefillPolicy": "round_robin"}),
            'proxy.prefillPolicy "round_robin" conflicts with kvRouting.prefillPolicy "kv"',
        ),
        (
            _with(kvRouting={"prefillPolicy": "least_load", "decodePolicy": "prefix"}),
            "without the kv policy",
        ),
        (_with(kvRouting={"eventsPort": 5600}), "overlaps engine.port 8000 or the side-channel"),
        (_with(kvRouting={"eventsPort": 7999}), "kvRouting.eventsPort 7999 (replay 8000)"),
        (_with(decode={"extraArgs": ["--no-enable-prefix-caching"]}), "prefix caching"),
    ],
)
def test_kv_routing_refuses_what_cannot_work(
    chart: helm.Chart, values: dict[str, Any], message: str
) -> None:
    with pytest.raises(helm.HelmError) as err:
        render(values, chart=chart)
    assert message in str(err.value)


def test_kv_routing_proxy_policy_equal_to_kv_routing_is_accepted(chart: helm.Chart) -> None:
    r = render(_with(proxy={"prefillPolicy": "kv"}), chart=chart)
    assert "--prefill-policy=kv" in container(_proxy(r))["args"]


# --- the rendered tokenizer wiring, run ------------------------------------------------------


def _tokenizer_files(dest: Path) -> None:
    """A small tokenizer with a chat template and a model config (AutoTokenizer reads it),
    saved as a model's files are."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {w: i for i, w in enumerate(["<unk>", "<s>", "hello", "world", "user", ":"])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>")
    fast.chat_template = "{% for m in messages %}{{ m.role }} : {{ m.content }} {% endfor %}"
    fast.save_pretrained(str(dest))
    (dest / "config.json").write_text(json.dumps({"model_type": "llama"}))


@pytest.mark.slow
def test_kv_routing_init_waits_for_the_engines_download_then_the_proxy_loads_it(
    chart: helm.Chart, tmp_path: Path
) -> None:
    """The init container's command, then pd-proxy's tokenizer, with the rendered env and the
    cache mount under tmp: a hub id resolves offline from the hub cache the engines fill."""
    r = render(_with(model={"name": "acme/tiny-chat"}), chart=chart)
    proxy = _proxy(r)
    (wait,) = pod_spec(proxy)["initContainers"]
    c = container(proxy)
    cache = tmp_path / "models"
    env = {
        **os.environ,
        **resolve_env(wait, secrets=fake_secrets(r), fields=fields("proxy-0")),
        "HF_HOME": str(cache),  # the mount, under tmp
        "HOME": "/nonexistent",  # the image's user has none
        "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}",
    }
    assert env["HF_HUB_OFFLINE"] == "1"
    cache.mkdir()
    proc = subprocess.Popen(
        wait["command"], env=env, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT
    )
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline().decode()
        assert "waiting for the tokenizer acme/tiny-chat" in line, line
        # The engines' download: the hub cache layout (refs/main names the snapshot).
        repo = cache / "hub" / "models--acme--tiny-chat"
        _tokenizer_files(repo / "snapshots" / "0123abc")
        (repo / "refs").mkdir()
        (repo / "refs" / "main").write_text("0123abc")
        for path in cache.rglob("*"):
            path.chmod(path.stat().st_mode & ~0o222)  # mounted read-only
        assert proc.wait(timeout=60) == 0, proc.stdout.read().decode()
    finally:
        proc.kill()
        proc.wait()
        if proc.stdout is not None:
            proc.stdout.close()
    tokenizer = load_proxy_settings(c["args"]).tokenizer
    script = (
        "import sys\n"
        "from proxy.kvroute.tokens import HFTokenizer\n"
        "t = HFTokenizer(sys.argv[1])\n"
        "print(t.encode(t.render_chat([{'role': 'user', 'content': 'hello world'}]), False))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script, str(tokenizer)],
        env=env,
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines()[-1] == "[4, 5, 2, 3]", done.stdout
