"""Real deployments for end-to-end tests, built with pd-launch's own plan and supervisor."""

from __future__ import annotations

import secrets
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import httpx
import pytest

from launch.cli import new_secret_file
from launch.credentials import ADMIN_TOKEN, PROXY_ADMIN_KEY
from launch.devices import CPU_SINGLE_PROCESS_WORKER
from launch.options import Child, LaunchOptions, LaunchPlan
from launch.plan import build_plan
from launch.supervisor import ChildFailed, Supervisor
from tests.e2e.observe import CREDENTIALS
from tests.support.procs import free_port, free_port_block

# Engine settings shared by the monolithic reference and the P/D engines: everything that can
# change numerics must be identical. Chunks of 56 tokens are deliberately not block-aligned.
BLOCK_SIZE = 32
CHUNK_TOKENS = 56
MAX_MODEL_LEN = 2048
# Extra vLLM arguments of every engine here, the reference included (they must match).
# --enforce-eager: torch.compile's cache never reloads on this torch, so every engine compiled
# again; one engine alone here answered /health after 109 s eager against 159 s compiled, and
# served a 1,600-token prompt in 1.4-1.6 s against 1.4 s, 128 tokens in 2.5 s against 2.3 s
# (docs/development.md). The compiled path runs in tests/e2e/test_pd_launch.py.
ENGINE_ARGS: tuple[str, ...] = ("--enforce-eager",)
PROXY_ARGS = ("--disagg-min-tokens", "0", "--decode-policy", "prefix", "--binding-marks")


KV_EVENTS_AT = 48  # kv_events_base_port = proxy_port + this
# How long a proxy's choice counts as held before the engines' events say so: the shared
# deployment's metaserver runs with this --kv-placed (10 s by default), so
# tests/e2e/test_kv_routing.py can wait it out and see routing follow the engines' events alone.
KV_PLACED_S = 1.0

_SECRET: list[str] = []


def side_channel_secret() -> str:
    """One key file for every deployment of the session: their side channels are sealed, as
    pd-launch seals them by default."""
    if not _SECRET:
        _SECRET.append(new_secret_file(Path(tempfile.mkdtemp(prefix="pdgate-e2e-"))))
    return _SECRET[0]


def base_options(model: Path, **over: object) -> LaunchOptions:
    opts = LaunchOptions(
        model=str(model),
        # one block: proxy, metaserver, up to 14 engine HTTP ports, then 32 side-channel ports,
        # then 16 for KV events (used when a deployment sets kv_events_base_port: KV_EVENTS_AT)
        proxy_port=(block := free_port_block(64)),
        metaserver_port=block + 1,
        engine_base_port=block + 2,
        side_channel_base_port=block + 16,
        max_model_len=MAX_MODEL_LEN,
        max_num_batched_tokens=CHUNK_TOKENS,
        block_size=BLOCK_SIZE,
        kv_load_timeout_s=60.0,
        extra_engine_args=ENGINE_ARGS,
        extra_proxy_args=PROXY_ARGS,
        side_channel_secret_file=side_channel_secret(),
        # metaserver roles: each engine acts only as itself (what pd-launch does by default)
        credentials_dir=tempfile.mkdtemp(prefix="pdgate-e2e-roles-"),
        # engines answer only the proxy (vLLM's VLLM_API_KEY), as pd-launch has them
        engine_api_key=secrets.token_urlsafe(24),
    )
    return replace(opts, **over)  # type: ignore[arg-type]


def monolithic_child(
    model: Path, *, max_model_len: int = MAX_MODEL_LEN, chunk_tokens: int = CHUNK_TOKENS
) -> Child:
    """A plain vLLM server (no connector) with the same engine settings: the reference."""
    port = free_port()
    opts = base_options(model)
    argv = [
        sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
        "--host", "127.0.0.1", "--port", str(port), "--served-model-name", model.name,
        "--max-model-len", str(max_model_len), "--max-num-batched-tokens", str(chunk_tokens),
        "--block-size", str(BLOCK_SIZE), "--gpu-memory-utilization", "0.1", "--dtype", "float32",
        *ENGINE_ARGS,
    ]  # fmt: skip
    env = {
        "VLLM_CPU_KVCACHE_SPACE": "1",
        "VLLM_CPU_OMP_THREADS_BIND": "nobind",
        "OMP_WAIT_POLICY": "PASSIVE",  # as pd-launch's CPU preset: it shares the cores
        **CPU_SINGLE_PROCESS_WORKER,  # as pd-launch's single-rank CPU engines
    }
    del opts
    return Child("monolithic", argv, f"http://127.0.0.1:{port}/health", env, kind="engine")


@dataclass
class Deployment:
    plan: LaunchPlan
    supervisor: Supervisor

    @property
    def proxy(self) -> str:
        return self.plan.proxy_url

    @property
    def metaserver(self) -> str:
        return self.plan.metaserver_url

    def url_of(self, name: str) -> str:
        child = next(c for c in self.plan.children if c.name == name)
        return child.health_url.removesuffix("/health").removesuffix("/ready")

    def log_of(self, name: str) -> str:
        """What child ``name`` has written to its log so far."""
        return (self.supervisor.log_dir / f"{name}.log").read_text(errors="replace")


# every deployment this session started, for the report of a failed test (``failure_report``)
STARTED: list[Supervisor] = []
TAIL_LINES = 25


def with_port(proxy: Child, port: int) -> Child:
    """``proxy`` (a plan's ``pd-proxy`` child) listening on ``port`` instead."""
    at = proxy.argv.index("--port") + 1
    argv = [*proxy.argv[:at], str(port), *proxy.argv[at + 1 :]]
    return replace(proxy, argv=argv, health_url=f"http://127.0.0.1:{port}/health")


def start(children: list[Child], log_dir: Path) -> Supervisor:
    sup = Supervisor(children, log_dir, out=lambda line: print(f"[e2e] {line}", flush=True))
    STARTED.append(sup)
    sup.start()
    return sup


def failure_report(since: float) -> str:
    """The last lines of the log of every deployment process that wrote to it since ``since``
    (a ``time.time()`` reading, the failed test's start): CI keeps no files, so a failed
    end-to-end test carries the logs that explain it."""
    parts = []
    for sup in STARTED:
        for name in sup.procs:
            log = sup.log_dir / f"{name}.log"
            try:
                if log.stat().st_mtime < since:
                    continue
            except FileNotFoundError:
                continue
            alive = "running" if sup.procs[name].poll() is None else "exited"
            parts.append(
                f"==== {log} ({alive}), last {TAIL_LINES} lines\n{sup.tail(name, TAIL_LINES)}"
            )
    return "\n".join(parts) or "no deployment process wrote to its log during the test"


def deployment(opts: LaunchOptions, log_dir: Path) -> Deployment:
    return deploy(build_plan(opts), log_dir)


# A cold vllm-cpu engine starts in 30-120 s here; a loaded CI machine starting several is slower.
READY_TIMEOUT_S = 900


def deploy(plan: LaunchPlan, log_dir: Path) -> Deployment:
    if plan.options.credentials_dir:  # roles: the suite observes as the operator would
        admin = Path(plan.options.credentials_dir) / ADMIN_TOKEN
        CREDENTIALS[plan.metaserver_url.rstrip("/")] = admin.read_text().strip()
        proxy_admin = Path(plan.options.credentials_dir) / PROXY_ADMIN_KEY
        CREDENTIALS[plan.proxy_url.rstrip("/")] = proxy_admin.read_text().strip()
    return Deployment(plan, start(plan.children, log_dir))


@contextmanager
def running(dep: Deployment, what: str) -> Iterator[Deployment]:
    """Wait until every child of ``dep`` is healthy (a child dying fails the test with its name),
    hand the deployment over, and always stop every child afterwards."""
    try:
        try:
            dep.supervisor.wait_ready(READY_TIMEOUT_S)
        except ChildFailed as exc:
            pytest.fail(f"{what} did not start: {exc}")
        wait_routable(dep, what)
        yield dep
    finally:
        dep.supervisor.stop()


# A proxy probes each engine every 5 s and only routes to one its probes saw healthy: an
# engine that failed the probes while it loaded can answer its own /health well before the
# proxy's next probe round sees it (30 s after in one run).
ROUTABLE_TIMEOUT_S = 120


def wait_routable(dep: Deployment, what: str, timeout_s: float = ROUTABLE_TIMEOUT_S) -> None:
    """Wait until each proxy of ``dep`` lists every engine of its plan healthy: a request sent
    before may find only part of a pool (the corrupting deployment's first request once found
    only the P it never pairs, and D computed alone)."""
    engines = sum(1 for c in dep.plan.children if c.name.startswith(("prefill", "decode")))
    creds = dep.plan.options.credentials_dir
    key = (Path(creds) / PROXY_ADMIN_KEY).read_text().strip() if creds else None
    headers = {"authorization": f"Bearer {key}"} if key else {}
    deadline = time.monotonic() + timeout_s
    for proxy in (c for c in dep.plan.children if c.name.startswith("proxy")):
        url = proxy.health_url.removesuffix("/health")
        listed: list[dict[str, Any]] = []
        while True:
            try:
                r = httpx.get(f"{url}/v1/instances", headers=headers, timeout=5)
            except httpx.HTTPError:
                listed = []
            else:
                if r.status_code == 403:  # no admin key: its view cannot be read
                    break
                listed = r.json()["instances"] if r.status_code == 200 else []
            if len(listed) >= engines and all(i["healthy"] for i in listed):
                break
            if time.monotonic() > deadline:
                seen = {i["url"]: i["healthy"] for i in listed}
                pytest.fail(f"{what}: {proxy.name} does not route to all {engines} engines: {seen}")
            time.sleep(0.5)


@contextmanager
def own_proxy(
    dep: Deployment, name: str, args: Sequence[str], log_dir: Path, like: str = "proxy"
) -> Iterator[str]:
    """A proxy of a test's own beside ``dep``: a copy of its child ``like`` on a free port with
    ``args`` added, ready; yields its url and always stops it afterwards."""
    plan_proxy = next(c for c in dep.plan.children if c.name == like)
    port = free_port()
    if "PD_PROXY_ADMIN_KEYS" in plan_proxy.env:  # the same operator key as the one it copies
        CREDENTIALS[f"http://127.0.0.1:{port}"] = plan_proxy.env["PD_PROXY_ADMIN_KEYS"]
    child = with_port(replace(plan_proxy, name=name), port)
    sup = start([replace(child, argv=[*child.argv, *args])], log_dir)
    try:
        sup.wait_ready(READY_TIMEOUT_S)
        yield f"http://127.0.0.1:{port}"
    finally:
        sup.stop()
