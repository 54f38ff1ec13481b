"""Run the rendered Redis and metaserver containers' commands for real, with the environment the
kubelet would build (Secret values, $(VAR) expansion): the wiring must hold up at run time.

Only what a cluster adds is emulated: volume mounts (a temp dir) and Service DNS (the Redis
Service name resolves to loopback).
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.chart.rendering import FULLNAME, REPO, container, render, resolve_env
from tests.chart.wiring import mount_credentials
from tests.support.procs import VENV_BIN, Process, free_port, wait_http, wait_port


def _fields(pod: str) -> dict[str, str]:
    return {"metadata.name": pod, "metadata.namespace": "serving", "status.podIP": "127.0.0.1"}


@pytest.fixture
def stack(tmp_path: Path) -> Iterator[dict[str, Any]]:
    if shutil.which("redis-server") is None:
        pytest.fail("redis-server is not installed (make install does it)")
    redis_port, meta_port, proxy_port, engine_port = (free_port() for _ in range(4))
    r = render(
        {
            "redis": {"port": redis_port},
            "metaserver": {"port": meta_port, "replicas": 2},
            "proxy": {"port": proxy_port},
            "engine": {"port": engine_port, "drain": {"settleS": 1, "timeoutS": 30}},
            # Per-pool tokens: the default per-pod ServiceAccount tokens need a TokenReview
            # API, which this stack has not (test_secure_defaults.py checks their wiring).
            "auth": {"engineIdentity": "poolToken"},
        }
    )
    secrets = {f"{FULLNAME}-auth": r.secret_data(f"{FULLNAME}-auth")}
    procs: list[Process] = []
    try:
        redis = container(r.get("StatefulSet", f"{FULLNAME}-redis"))
        redis_env = resolve_env(redis, secrets=secrets, fields=_fields("redis-0"))
        data = tmp_path / "data"
        data.mkdir()
        (mount,) = [m["mountPath"] for m in redis["volumeMounts"] if m["name"] == "data"]
        argv = redis["command"] + [a.replace(mount, str(data)) for a in redis["args"]]
        procs.append(Process(argv, env=redis_env, log=tmp_path / "redis.log"))
        wait_port(redis_port)

        ms = container(r.get("Deployment", f"{FULLNAME}-metaserver"))
        ms_env = resolve_env(ms, secrets=secrets, fields=_fields("ms-0"))
        ms_env |= mount_credentials(r, secrets, tmp_path / "ms-root") or {}
        # Cluster DNS: the Redis Service name is this machine.
        ms_env["PD_METASERVER_STORE"] = ms_env["PD_METASERVER_STORE"].replace(
            f"@{FULLNAME}-redis:", "@127.0.0.1:"
        )
        exe = str(VENV_BIN / ms["command"][0])
        ms_proc = Process([exe, *ms["args"]], env=ms_env, log=tmp_path / "metaserver.log")
        procs.append(ms_proc)
        wait_http(f"http://127.0.0.1:{meta_port}/health", proc=ms_proc)
        yield {
            "render": r,
            "redis": redis,
            "redis_env": redis_env,
            "metaserver": ms,
            "meta_port": meta_port,
            "proxy_port": proxy_port,
            "engine_port": engine_port,
            "tmp": tmp_path,
            "secrets": secrets,
        }
    finally:
        for p in reversed(procs):
            p.stop()


def test_live_redis_requires_the_generated_password(stack: dict[str, Any]) -> None:
    redis = stack["redis"]
    probe = redis["readinessProbe"]["exec"]["command"]
    ok = subprocess.run(probe, env={"PATH": "/usr/bin:/bin", **stack["redis_env"]}, timeout=10)
    assert ok.returncode == 0, "the rendered readiness probe fails against the rendered server"
    no_auth = {k: v for k, v in stack["redis_env"].items() if k != "REDISCLI_AUTH"}
    denied = subprocess.run(probe, env={"PATH": "/usr/bin:/bin", **no_auth}, timeout=10)
    assert denied.returncode != 0, "Redis answered without the password"


def test_live_metaserver_probes_and_token(stack: dict[str, Any]) -> None:
    ms = stack["metaserver"]
    base = f"http://127.0.0.1:{stack['meta_port']}"
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        path = ms[probe]["httpGet"]["path"]
        assert httpx.get(base + path, timeout=5).status_code == 200, probe

    token = stack["secrets"][f"{FULLNAME}-auth"]["token"]
    spec = {
        "role": "decode",
        "url": "http://10.0.0.9:8000",
        "kv_endpoint": {"host": "10.0.0.9", "port": 5600},
    }
    denied = httpx.put(f"{base}/v1/instances/d-0", json=spec, timeout=5)
    assert denied.status_code == 401
    wrong = httpx.put(
        f"{base}/v1/instances/d-0",
        json=spec,
        timeout=5,
        headers={"Authorization": "Bearer not-the-token"},
    )
    assert wrong.status_code == 401
    ok = httpx.put(
        f"{base}/v1/instances/d-0",
        json=spec,
        timeout=5,
        headers={"Authorization": f"Bearer {token}"},
    )
    assert ok.status_code in (200, 201), ok.text
    # reads need a credential too (metaserver.protectReads, on by default: issue 46)
    assert httpx.get(f"{base}/v1/instances", timeout=5).status_code == 401
    listed = httpx.get(
        f"{base}/v1/instances", timeout=5, headers={"Authorization": f"Bearer {token}"}
    ).json()
    assert "d-0" in str(listed)
    # roles (the chart's default): the decode pool's token acts only as a decode pod
    pool = {"Authorization": f"Bearer {stack['secrets'][f'{FULLNAME}-auth']['decode-token']}"}
    pod = {
        **spec,
        "url": "http://10.0.0.10:8000",
        "kv_endpoint": {"host": "10.0.0.10", "port": 5600},
    }
    own = httpx.put(f"{base}/v1/instances/{FULLNAME}-decode-1", json=pod, headers=pool)
    assert own.status_code == 201, own.text  # (d-0 above holds the first URL: one per URL)
    other = httpx.put(f"{base}/v1/instances/{FULLNAME}-prefill-1", json=spec, headers=pool)
    assert other.status_code == 403, other.text
    # The write went to the rendered Redis (state shared by the metaserver replicas).
    assert "d-0" in _redis_cli(stack, "--scan", "--pattern", "pdgate:*").stdout


def _redis_cli(stack: dict[str, Any], *args: str, user: str = "pdgate") -> Any:
    """``redis-cli`` against the rendered Redis as ``user`` (the metaserver's ACL user), with
    the password the rendered environment holds."""
    port = str(stack["render"].get("Service", f"{FULLNAME}-redis")["spec"]["ports"][0]["port"])
    return subprocess.run(
        ["redis-cli", "-p", port, "--user", user, *args],
        env={"PATH": "/usr/bin:/bin", **stack["redis_env"]},
        capture_output=True,
        text=True,
        timeout=10,
    )


def test_live_redis_gives_the_metaserver_its_own_keys_and_nothing_dangerous(
    stack: dict[str, Any],
) -> None:
    """The metaserver's ACL user writes under the key prefix, nowhere else, runs no
    ``@dangerous`` command; the default user is off (the password alone opens nothing)."""
    assert _redis_cli(stack, "set", "pdgate:probe", "1").stdout.strip() == "OK"
    for denied in (("set", "other:key", "1"), ("flushall",), ("config", "get", "*"), ("keys", "*")):
        got = _redis_cli(stack, *denied)
        assert "NOPERM" in got.stdout + got.stderr, (denied, got)
    default = _redis_cli(stack, "ping", user="default")
    assert "PONG" not in default.stdout, default


@contextmanager
def _fake_engine(host: str, port: int) -> Iterator[None]:
    """Stands in for a vLLM engine (needs an accelerator and a model): answers GET /health."""

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.send_response(200 if self.path == "/health" else 404)
            self.send_header("Content-Length", "0")
            self.end_headers()

        def log_message(self, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer((host, port), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield
    finally:
        server.shutdown()
        server.server_close()
        thread.join(5)


def _wait_status(url: str, wanted: int, timeout: float = 30.0) -> int:
    deadline = time.monotonic() + timeout
    status = 0
    while time.monotonic() < deadline:
        status = httpx.get(url, timeout=5).status_code
        if status == wanted:
            break
        time.sleep(0.2)
    return status


def test_live_proxy_probes_follow_the_pools(stack: dict[str, Any]) -> None:
    """The rendered pd-proxy command starts; liveness holds while the pools are empty and
    readiness turns green once an engine of each pool answers at the rendered DNS names."""
    r = stack["render"]
    proxy = container(r.get("Deployment", f"{FULLNAME}-proxy"))
    env = resolve_env(proxy, secrets=stack["secrets"], fields=_fields("proxy-0"))
    port = stack["engine_port"]
    # Cluster DNS: each pool's headless Service resolves to its (one) pod.
    dns = {
        f"{FULLNAME}-prefill.serving.svc.cluster.local": "127.0.0.2",
        f"{FULLNAME}-decode.serving.svc.cluster.local": "127.0.0.1",
        f"//{FULLNAME}-metaserver:": "//127.0.0.1:",
    }
    args = []
    for arg in proxy["args"]:
        for name, addr in dns.items():
            arg = arg.replace(name, addr)
        args.append(arg)
    exe = VENV_BIN / "pd-proxy"
    argv = [str(exe)] if exe.exists() else [sys.executable, "-m", "proxy.cli"]
    argv += [*args, "--health-interval", "0.2", "--discovery-interval", "0.2"]
    proc = Process(argv, env=env, log=stack["tmp"] / "proxy.log")
    base = f"http://127.0.0.1:{stack['proxy_port']}"
    try:
        wait_port(stack["proxy_port"])
        ready = proxy["readinessProbe"]["httpGet"]["path"]
        assert proxy["livenessProbe"]["tcpSocket"]["port"] == "http"
        # No engine answers yet: once the proxy's probes have failed, it is not ready.
        assert _wait_status(base + ready, 503) == 503, proc.tail()
        with _fake_engine("127.0.0.2", port), _fake_engine("127.0.0.1", port):
            assert _wait_status(base + ready, 200) == 200, proc.tail()
            body = httpx.get(base + ready, timeout=5).json()
            assert body["available"] == {"prefill": 1, "decode": 1}
        assert proc.alive(), "the proxy died while its pools were empty"
    finally:
        proc.stop()


def test_live_engine_prestop_drains_then_lets_termination_go_on(stack: dict[str, Any]) -> None:
    """The rendered preStop command, run with the decode pod's environment: it marks the pod's
    registration draining through the rendered metaserver (with the token from the Secret),
    waits while the engine's /metrics shows a request running (vLLM's gauge, served by
    prometheus_client as vLLM does), and exits 0 once it is idle."""
    from prometheus_client import CollectorRegistry, Gauge, start_http_server

    r = stack["render"]
    decode = container(r.get("StatefulSet", f"{FULLNAME}-decode"))
    pod = f"{FULLNAME}-decode-0"
    env = resolve_env(decode, secrets=stack["secrets"], fields=_fields(pod))
    base = f"http://127.0.0.1:{stack['meta_port']}"
    token = stack["secrets"][f"{FULLNAME}-auth"]["token"]
    spec = {"role": "decode", "url": f"http://127.0.0.1:{stack['engine_port']}"}
    auth = {"Authorization": f"Bearer {token}"}
    assert httpx.put(f"{base}/v1/instances/{pod}", json=spec, headers=auth).status_code == 201

    # vLLM's scheduler gauges (vllm/v1/metrics/loggers.py, PrometheusStatLogger.__init__)
    reg = CollectorRegistry()
    running = Gauge("vllm:num_requests_running", "r", ["model_name", "engine"], registry=reg)
    Gauge("vllm:num_requests_waiting", "w", ["model_name", "engine"], registry=reg).labels(
        "m", "0"
    ).set(0)
    running.labels("m", "0").set(1)
    server, thread = start_http_server(stack["engine_port"], addr="127.0.0.1", registry=reg)
    idle_at = threading.Timer(2.0, lambda: running.labels("m", "0").set(0))
    try:
        command = decode["lifecycle"]["preStop"]["exec"]["command"]
        assert command[0] == "python3"  # the images' interpreter, with pdgate installed
        argv = [sys.executable, *command[1:]]
        argv = [a.replace(f"//{FULLNAME}-metaserver:", "//127.0.0.1:") for a in argv]
        started = time.monotonic()
        idle_at.start()
        done = subprocess.run(
            argv,
            env={**env, "PATH": "/usr/bin:/bin", "PYTHONPATH": str(REPO)},
            capture_output=True,
            text=True,
            timeout=60,
        )
        took = time.monotonic() - started
    finally:
        idle_at.cancel()
        server.shutdown()
        server.server_close()
        thread.join(5)
    assert done.returncode == 0, done.stderr
    assert 2.0 <= took < 20, done.stderr  # waited for the running request, not the timeout
    assert "marked draining" in done.stderr and "engine idle" in done.stderr
    got = httpx.get(f"{base}/v1/instances/{pod}", headers=auth).json()
    assert got["draining"] is True
