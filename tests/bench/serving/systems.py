"""The three systems the serving bench compares, on the same two cores, each engine pinned:

- ``aggregated``: two monolithic vLLM engines (one per core, no connector) behind pd-proxy with
  ``--flow direct`` (each engine computes its own prompts; chunked prefill and prefix caching as
  vLLM sets them);
- ``pd``: 1P1D decode-first, P on core 0 and D on core 1, every request through P;
- ``conditional``: the same 1P1D with ``--disagg-min-tokens`` / ``--cached-skip-ratio``: short or
  cached prompts stay on D.

Engines share every setting (model, ``--max-model-len``, block size, eager or compiled); the
metaserver and the proxy float over both cores in every system (the aggregated one has a proxy
too). Pinning as in ``ttft_bench.py``: ``taskset`` for the process, vLLM's OpenMP threads bound
to the same core."""

from __future__ import annotations

import sys
from dataclasses import dataclass, replace
from pathlib import Path

from launch.credentials import ADMIN_TOKEN
from launch.options import Child
from launch.plan import build_plan
from tests.e2e.stack import BLOCK_SIZE, base_options
from tests.support.procs import free_port

SYSTEMS = ("aggregated", "pd", "conditional")
CORES = ("0", "1")
MAX_MODEL_LEN = 4096
PROXY_ARGS = ("--decode-policy", "prefix", "--binding-marks")


@dataclass(frozen=True)
class Engines:
    model: Path
    eager: bool

    def args(self) -> list[str]:
        return [
            "--max-model-len", str(MAX_MODEL_LEN), "--block-size", str(BLOCK_SIZE),
            "--gpu-memory-utilization", "0.1", "--dtype", "float32",
            *(["--enforce-eager"] if self.eager else []),
        ]  # fmt: skip


@dataclass(frozen=True)
class System:
    name: str
    children: list[Child]
    url: str  # the proxy's
    metaserver: str | None
    admin_token: str | None = None  # the metaserver's admin credential (its reads need one)


def pinned(child: Child, core: str) -> Child:
    env = dict(child.env)
    if child.kind == "engine":
        env["VLLM_CPU_OMP_THREADS_BIND"] = core
    return replace(child, argv=["taskset", "-c", core, *child.argv], env=env)


def aggregated(e: Engines) -> System:
    children, urls = [], []
    for i, core in enumerate(CORES):
        port = free_port()
        argv = [
            sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(e.model),
            "--host", "127.0.0.1", "--port", str(port), "--served-model-name", e.model.name,
            *e.args(),
        ]  # fmt: skip
        env = {
            "VLLM_CPU_KVCACHE_SPACE": "1",
            "OMP_WAIT_POLICY": "PASSIVE",
            "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
        }
        child = Child(f"engine-{i}", argv, f"http://127.0.0.1:{port}/health", env, kind="engine")
        children.append(pinned(child, core))
        urls.append(f"http://127.0.0.1:{port}")
    port = free_port()
    proxy = [
        sys.executable, "-m", "proxy.cli", "--host", "127.0.0.1", "--port", str(port),
        "--flow", "direct", *(x for u in urls for x in ("--decode", u)), *PROXY_ARGS[:2],
    ]  # fmt: skip
    children.append(Child("proxy", proxy, f"http://127.0.0.1:{port}/health", kind="gate"))
    return System("aggregated", children, f"http://127.0.0.1:{port}", None)


def one_p_one_d(e: Engines, name: str, min_tokens: int = 0, skip_ratio: float = 0.0) -> System:
    extra = (*PROXY_ARGS, "--disagg-min-tokens", str(min_tokens),
             "--cached-skip-ratio", str(skip_ratio))  # fmt: skip
    opts = replace(
        base_options(e.model),
        max_model_len=MAX_MODEL_LEN,
        max_num_batched_tokens=None,
        extra_engine_args=("--enforce-eager",) if e.eager else (),
        extra_proxy_args=extra,
    )
    plan = build_plan(opts)
    children = [
        pinned(c, CORES[0]) if c.name.startswith("prefill")
        else pinned(c, CORES[1]) if c.name.startswith("decode")
        else c
        for c in plan.children
    ]  # fmt: skip
    admin = (Path(opts.credentials_dir) / ADMIN_TOKEN).read_text().strip()
    return System(name, children, plan.proxy_url, plan.metaserver_url, admin)
