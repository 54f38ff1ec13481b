"""Serving benchmark: what disaggregation buys on the real model under load, against the same two
cores aggregated (``tests/bench/serving/``: workload, client, systems, report).

    .venv/bin/python tests/bench/serving_bench.py [--model smollm2|tiny|small] \
        [--rates 0.05,0.1,0.2,0.4] [--duration 120] [--pattern poisson|bursty] [--runs 3] \
        [--systems aggregated,pd,conditional] [--slo-ttft 4.0] [--slo-itl 0.15] \
        [--also-slo TTFT_S:ITL_S ...] \
        [--disagg-min-tokens N] [--cached-skip-ratio 0.5] [--eager] [--seed 1] [--out DIR]

For each run, each system in turn is started (engines pinned, ``systems.py``), swept through
every rate (open-loop arrivals for ``--duration`` seconds each, then until every answer is in),
and stopped: the systems alternate, so a machine that drifts during the bench drifts for all of
them. Every system gets the same requests at a given rate and run; each rate and run has
prompts of its own (no prefix-cache hit carries over from the previous point).

``conditional`` uses ``--disagg-min-tokens`` when given, else the metaserver's suggestion after
the run's ``pd`` sweep (``/v1/breakdown``'s ``disaggregation.suggested_min_tokens``), else 1024.

Output: the table of every point, goodput's spread over the runs (at ``--slo-ttft``/``--slo-itl``
and at each ``--also-slo``), ``goodput.png`` and ``itl.png`` under ``--out`` (default
``.cache/serving-bench``), and ``points.json`` there: every point with each request's kind,
prompt length, TTFT, mean ITL and tokens, and every inter-token gap, so goodput at another SLO
can be computed afterwards.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

import httpx  # noqa: E402

from launch.supervisor import Supervisor  # noqa: E402
from tests.bench.serving import client, report, systems, workload  # noqa: E402
from tests.bench.serving.report import Point, Slo  # noqa: E402

FALLBACK_MIN_TOKENS = 1024


def say(line: str) -> None:
    print(f"[serving] {line}", flush=True)


def model_path(name: str) -> Path:
    cache = REPO / ".cache" / "models"
    if name == "smollm2":
        from launch.smollm2 import make_smollm2

        return make_smollm2(cache, log=say)
    from launch.tiny_model import make_small_model, make_tiny_model

    return (make_tiny_model if name == "tiny" else make_small_model)(cache)


def requests_by_flow(url: str) -> dict[str, float]:
    """The proxy's ``pd_requests_total`` summed per flow."""
    text = httpx.get(url + "/metrics", timeout=10).raise_for_status().text
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("pd_requests_total{"):
            labels, value = line.rsplit(" ", 1)
            flow = labels.split('flow="', 1)[1].split('"', 1)[0]
            out[flow] = out.get(flow, 0.0) + float(value)
    return out


def disaggregated(before: dict[str, float], after: dict[str, float]) -> float | None:
    delta = {f: after.get(f, 0.0) - before.get(f, 0.0) for f in after}
    total = sum(delta.values())
    return None if total <= 0 else 1 - delta.get("direct", 0.0) / total


def suggested_min_tokens(system: systems.System) -> int | None:
    """The metaserver's ``--disagg-min-tokens`` suggestion over what the system served."""
    assert system.metaserver is not None
    headers = {"authorization": f"Bearer {system.admin_token}"} if system.admin_token else {}
    url = system.metaserver + "/v1/breakdown"
    r = httpx.get(url, params={"window": 3600}, headers=headers, timeout=30)
    if r.status_code != 200:
        return None
    value = r.json().get("advice", {}).get("disaggregation", {}).get("suggested_min_tokens")
    return None if value is None else int(value)


def also_slo(text: str) -> Slo:
    try:
        ttft, itl = (float(x) for x in text.split(":"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: want TTFT_S:ITL_S, e.g. 4:0.15") from None
    if ttft <= 0 or itl <= 0:
        raise argparse.ArgumentTypeError(f"{text!r}: both must be > 0")
    return Slo(ttft, itl)


def sweep(a: argparse.Namespace, system: systems.System, run: int, model: str) -> list[Point]:
    points = []
    for k, rate in enumerate(a.rates):
        reqs = workload.build(a.seed + 1000 * run + k, rate, a.duration, a.pattern)
        before = requests_by_flow(system.url)
        t0 = time.monotonic()
        results = asyncio.run(client.run(system.url, model, reqs, a.request_timeout))
        say(f"{system.name} run {run} rate {rate:g}/s: {len(reqs)} requests in "
            f"{time.monotonic() - t0:.0f} s, {sum(not r.ok for r in results)} failed")  # fmt: skip
        via = disaggregated(before, requests_by_flow(system.url))
        points.append(Point(system.name, rate, run, a.duration, results, via))
    return points


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", choices=("smollm2", "tiny", "small"), default="smollm2")
    ap.add_argument("--rates", type=lambda s: [float(x) for x in s.split(",")],
                    default=[0.05, 0.1, 0.2, 0.4])  # fmt: skip
    ap.add_argument("--duration", type=float, default=120.0)
    ap.add_argument("--pattern", choices=("poisson", "bursty"), default="poisson")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--systems", type=lambda s: s.split(","), default=list(systems.SYSTEMS))
    ap.add_argument("--slo-ttft", type=float, default=4.0)
    ap.add_argument("--slo-itl", type=float, default=0.15)
    ap.add_argument("--also-slo", type=also_slo, action="append", default=[],
                    metavar="TTFT_S:ITL_S", help="another SLO to report goodput at")  # fmt: skip
    ap.add_argument("--disagg-min-tokens", type=int, default=None)
    ap.add_argument("--cached-skip-ratio", type=float, default=0.5)
    ap.add_argument("--eager", action="store_true", help="engines with --enforce-eager")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--request-timeout", type=float, default=600.0)
    ap.add_argument("--ready-timeout", type=float, default=900.0)
    ap.add_argument("--out", type=Path, default=REPO / ".cache" / "serving-bench")
    a = ap.parse_args()
    unknown = set(a.systems) - set(systems.SYSTEMS)
    if unknown:
        ap.error(f"unknown system(s) {sorted(unknown)}; choose from {systems.SYSTEMS}")
    path = model_path(a.model)
    engines = systems.Engines(path, a.eager)
    slo = Slo(a.slo_ttft, a.slo_itl)
    points: list[Point] = []
    for run in range(a.runs):
        min_tokens = a.disagg_min_tokens
        for name in a.systems:
            if name == "aggregated":
                system = systems.aggregated(engines)
            elif name == "pd":
                system = systems.one_p_one_d(engines, "pd")
            else:
                chosen = min_tokens if min_tokens is not None else FALLBACK_MIN_TOKENS
                system = systems.one_p_one_d(engines, "conditional", chosen, a.cached_skip_ratio)
                say(f"conditional: --disagg-min-tokens {chosen} --cached-skip-ratio "
                    f"{a.cached_skip_ratio}")  # fmt: skip
            sup = Supervisor(system.children, a.out / "logs" / f"{name}-{run}",
                             out=lambda line: say(f"  {line}"))  # fmt: skip
            say(f"run {run + 1}/{a.runs}: starting {name} …")
            try:
                sup.start()
                sup.wait_ready(a.ready_timeout)
                points += sweep(a, system, run, path.name)
                if name == "pd" and system.metaserver and a.disagg_min_tokens is None:
                    suggested = suggested_min_tokens(system)
                    min_tokens = suggested if suggested is not None else min_tokens
                    say(f"the metaserver suggests --disagg-min-tokens {suggested}")
            finally:
                sup.stop()
    print(report.table(points, slo))
    print()
    for each in (slo, *a.also_slo):
        print(f"\nTTFT <= {each.ttft_s:g} s, mean ITL <= {each.itl_s * 1000:g} ms:")
        print(report.spread(points, each))
    pictures = report.pictures(points, slo, a.out)
    dump = [
        {"system": p.system, "rate": p.rate, "run": p.run, "duration_s": p.duration_s,
         "goodput": p.goodput(slo), "throughput": p.throughput(),
         "disaggregated": p.disaggregated, "failed": len(p.results) - len(p.ok()),
         "requests": [{"kind": r.req.kind, "prompt": len(r.req.prompt), "ok": r.ok,
                       "ttft": r.ttft_s, "mean_itl": r.mean_itl(), "tokens": r.tokens}
                      for r in p.results],
         "itls": p.itls()}
        for p in points
    ]  # fmt: skip
    (a.out / "points.json").write_text(json.dumps(dump, indent=1))
    say("pictures: " + ", ".join(str(p) for p in pictures))


if __name__ == "__main__":
    main()
