"""TTFT measurement pieces for ``ttft_bench.py``: exact-length token-id prompts, one streamed
completion timed to its first content chunk, percentiles, and the push-overlap numbers the
connector reports in each binding's ``done`` event."""

from __future__ import annotations

import itertools
import json
import random
import statistics
import time
from dataclasses import dataclass, field
from typing import Any

import httpx

from pdwire.push_summary import parse
from tests.bench.corecpu import CoreCpu


@dataclass
class Sample:
    size: int
    ttft_s: float
    total_s: float
    sent_at: float  # wall clock (the metaserver's bindings carry wall-clock times)
    ended_at: float


@dataclass
class Cell:
    """One (target, flow, prompt size): its samples, or the error that stopped it."""

    samples: list[Sample] = field(default_factory=list)
    error: str = ""
    overlap: list[dict[str, float]] = field(default_factory=list)  # one per matched binding
    phases: list[list[float]] = field(default_factory=list)  # seconds per PHASES entry
    raw: list[dict[str, Any]] = field(default_factory=list)  # matched binding, its times
    # mean of D's kv_ready_wait_seconds over the timed runs (P's done signal on D -> D's first
    # step of the request), from D's /metrics; None where not measured
    ready_wait_s: float | None = None
    # --pinned: CPU per timed request on the pinned core
    core_cpu: CoreCpu | None = None

    def ttfts(self) -> list[float]:
        return [s.ttft_s for s in self.samples]


def prompt(n: int, seed: int) -> list[int]:
    """``n`` random token ids in 3..1000 (no special tokens); a new seed per request, so no
    prefix-cache hit helps anybody."""
    rng = random.Random(seed)
    return [rng.randint(3, 1000) for _ in range(n)]


def histogram_totals(http: httpx.Client, metrics_url: str, name: str) -> tuple[float, float]:
    """(sum, count) of a histogram on a Prometheus text page, over all its label sets."""
    text = http.get(metrics_url).raise_for_status().text
    total = {"_sum": 0.0, "_count": 0.0}
    for line in text.splitlines():
        for suffix in total:
            if line.startswith((name + suffix + "{", name + suffix + " ")):
                total[suffix] += float(line.rsplit(" ", 1)[1])
    return total["_sum"], total["_count"]


def percentile(xs: list[float], q: float) -> float:
    """Linear-interpolated percentile (q in 0..100) of a non-empty list."""
    s = sorted(xs)
    if len(s) == 1:
        return s[0]
    pos = (len(s) - 1) * q / 100.0
    lo = int(pos)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def median(xs: list[float]) -> float:
    return statistics.median(xs)


class StreamError(RuntimeError):
    pass


def ttft(
    http: httpx.Client,
    base_url: str,
    model: str,
    ids: list[int],
    *,
    max_tokens: int,
    flow: str | None = None,
) -> Sample:
    """POST a streamed completion; TTFT ends at the first ``data:`` event carrying a choice."""
    body: dict[str, Any] = {
        "model": model,
        "prompt": ids,
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "ignore_eos": True,
    }
    headers = {"x-pd-flow": flow} if flow else {}
    sent_wall = time.time()
    t0 = time.perf_counter()
    first: float | None = None
    with http.stream("POST", base_url + "/v1/completions", json=body, headers=headers) as r:
        if r.status_code != 200:
            raise StreamError(f"HTTP {r.status_code}: {r.read().decode(errors='replace')[:300]}")
        for line in r.iter_lines():
            if not line.startswith("data:"):
                continue
            data = line[5:].strip()
            if data == "[DONE]":
                break
            event = json.loads(data)
            if "error" in event:
                raise StreamError(f"stream error: {json.dumps(event['error'])[:300]}")
            if first is None and event.get("choices"):
                first = time.perf_counter()
    end = time.perf_counter()
    if first is None:
        raise StreamError("stream ended without a content chunk")
    return Sample(len(ids), first - t0, end - t0, sent_wall, time.time())


# sent -> D's binding at the metaserver -> P scheduled it (prefill_started at the metaserver)
# -> P's forward of the last chunk ended (P's clock) -> first token at the client
PHASES = ("to D's binding", "to P's start", "P compute", "P end to 1st token")


def attach_bindings(metaserver: str, cells: list[Cell], token: str | None = None) -> int:
    """Match the metaserver's bindings to the cells' samples (prompt length, creation time in
    the request's wall-clock window); keep each ``done`` event's push statistics and the
    request's timeline. Returns how many samples found their binding. ``token``: a credential
    the metaserver's reads take (pd-launch's admin token)."""
    headers = {"authorization": f"Bearer {token}"} if token else {}
    with httpx.Client(timeout=10, headers=headers) as http:
        r = http.get(metaserver + "/v1/bindings", params={"limit": 1000})
        r.raise_for_status()
        bindings: list[dict[str, Any]] = r.json().get("bindings", [])
    matched = 0
    for cell in cells:
        for s in cell.samples:
            first_at = s.sent_at + s.ttft_s
            # D's binding exists before P computes, so before the first token: the earliest
            # binding of this length created in [sent, first token] is the request's own
            mine = [
                b
                for b in bindings
                if b.get("num_prompt_tokens") == s.size
                and s.sent_at - 0.05 <= float(b.get("created_at", 0)) <= first_at + 0.05
            ]
            if not mine:
                continue
            b = min(mine, key=lambda b: float(b["created_at"]))
            at = {e.get("state"): e for e in b.get("events", [])}
            done = at.get("done")
            stats = parse((done.get("detail") or {}).get("message")) if done else {}
            if stats:
                cell.overlap.append(stats)
                matched += 1
            times = [float(at[k]["at"]) for k in ("bound", "prefill_started") if k in at]
            if stats.get("p_end_at") and len(times) == 2:
                marks = [s.sent_at, *times, stats["p_end_at"], first_at]
                cell.phases.append([b - a for a, b in itertools.pairwise(marks)])
                cell.raw.append({"tid": b["transfer_id"], "sent": s.sent_at, "marks": marks})
    return matched
