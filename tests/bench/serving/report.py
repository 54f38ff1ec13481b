"""What one system did at one rate (``Point``), the table of every point, and the pictures.

Goodput counts the requests per second that met the SLO: a first token within ``ttft_s`` and a
mean inter-token latency within ``itl_s`` (a one-token answer meets the second by definition).
Latencies are over the requests that were answered; failed ones count against goodput only."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from tests.bench.serving.client import Result
from tests.bench.ttft_client import percentile


@dataclass(frozen=True)
class Slo:
    ttft_s: float
    itl_s: float

    def met(self, r: Result) -> bool:
        itl = r.mean_itl()
        return (
            r.ok
            and r.ttft_s is not None
            and r.ttft_s <= self.ttft_s
            and (itl is None or itl <= self.itl_s)
        )


@dataclass
class Point:
    system: str
    rate: float
    run: int
    duration_s: float
    results: list[Result]
    disaggregated: float | None = None  # share of requests sent through P (proxy's counters)

    def ok(self) -> list[Result]:
        return [r for r in self.results if r.ok]

    def ttfts(self) -> list[float]:
        return [r.ttft_s for r in self.ok() if r.ttft_s is not None]

    def itls(self) -> list[float]:
        return [g for r in self.ok() for g in r.gaps_s]

    def totals(self) -> list[float]:
        return [r.total_s for r in self.ok() if r.total_s is not None]

    def throughput(self) -> float:
        return len(self.ok()) / self.duration_s

    def tokens_per_s(self) -> float:
        return sum(r.tokens for r in self.ok()) / self.duration_s

    def goodput(self, slo: Slo) -> float:
        return sum(1 for r in self.results if slo.met(r)) / self.duration_s


def _ms(xs: list[float], q: float) -> str:
    return f"{percentile(xs, q) * 1000:.0f}" if xs else "–"


HEADER = (
    "system", "rate/s", "run", "sent", "failed", "TTFT p50/p90/p99 ms", "ITL p50/p90/p99 ms",
    "e2e p50/p90 s", "req/s", "tok/s", "goodput/s", "via P",
)  # fmt: skip


def row(p: Point, slo: Slo) -> list[str]:
    t, i, e = p.ttfts(), p.itls(), p.totals()
    via = "–" if p.disaggregated is None else f"{p.disaggregated:.0%}"
    return [
        p.system, f"{p.rate:g}", str(p.run), str(len(p.results)),
        str(len(p.results) - len(p.ok())),
        "/".join(_ms(t, q) for q in (50, 90, 99)),
        "/".join(_ms(i, q) for q in (50, 90, 99)),
        "/".join(f"{percentile(e, q):.1f}" if e else "–" for q in (50, 90)),
        f"{p.throughput():.2f}", f"{p.tokens_per_s():.1f}", f"{p.goodput(slo):.2f}", via,
    ]  # fmt: skip


def table(points: Sequence[Point], slo: Slo) -> str:
    lines = ["| " + " | ".join(HEADER) + " |", "|" + "---|" * len(HEADER)]
    lines += ["| " + " | ".join(row(p, slo)) + " |" for p in points]
    return "\n".join(lines)


def spread(points: Sequence[Point], slo: Slo) -> str:
    """Goodput per system and rate over the runs: median [min–max]."""
    by: dict[tuple[str, float], list[float]] = {}
    for p in points:
        by.setdefault((p.system, p.rate), []).append(p.goodput(slo))
    lines = ["| system | rate/s | goodput/s, median [min–max] over runs |", "|---|---|---|"]
    for (system, rate), xs in sorted(by.items()):
        xs.sort()
        lines.append(f"| {system} | {rate:g} | {xs[len(xs) // 2]:.2f} [{xs[0]:.2f}–{xs[-1]:.2f}] |")
    return "\n".join(lines)


def pictures(points: Sequence[Point], slo: Slo, out: Path) -> list[Path]:
    """``goodput.png`` (goodput against rate, per system: median and the runs' range) and
    ``itl.png`` (the inter-token latency distribution per system at the highest rate)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out.mkdir(parents=True, exist_ok=True)
    systems = sorted({p.system for p in points})
    fig, ax = plt.subplots(figsize=(6.4, 4.0))
    for system in systems:
        rates = sorted({p.rate for p in points if p.system == system})
        runs = [[p.goodput(slo) for p in points if p.system == system and p.rate == r]
                for r in rates]  # fmt: skip
        mid = [sorted(g)[len(g) // 2] for g in runs]
        ax.plot(rates, mid, marker="o", label=system)
        ax.fill_between(rates, [min(g) for g in runs], [max(g) for g in runs], alpha=0.2)
    ax.set_xlabel("arrival rate (requests/s)")
    ax.set_ylabel(f"goodput (req/s, TTFT ≤ {slo.ttft_s:g} s, ITL ≤ {slo.itl_s * 1000:g} ms)")
    ax.legend()
    ax.grid(alpha=0.3)
    goodput = out / "goodput.png"
    fig.tight_layout()
    fig.savefig(goodput, dpi=120)
    plt.close(fig)

    top = max(p.rate for p in points)
    fig, ax = plt.subplots(figsize=(6.4, 4.0))
    for system in systems:
        gaps = sorted(g for p in points if p.system == system and p.rate == top for g in p.itls())
        if gaps:
            ys = [(i + 1) / len(gaps) for i in range(len(gaps))]
            ax.plot([g * 1000 for g in gaps], ys, label=system)
    ax.set_xscale("log")
    ax.set_xlabel("inter-token latency (ms, log)")
    ax.set_ylabel("share of tokens")
    ax.set_title(f"at {top:g} requests/s")
    ax.axvline(slo.itl_s * 1000, color="grey", linestyle="--", linewidth=1)
    ax.legend()
    ax.grid(alpha=0.3)
    itl = out / "itl.png"
    fig.tight_layout()
    fig.savefig(itl, dpi=120)
    plt.close(fig)
    return [goodput, itl]
