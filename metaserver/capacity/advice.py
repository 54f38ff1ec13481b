"""A P:D recommendation from a breakdown (``capacity.breakdown``) and a TTFT target.

The model, per pool, from the window's own numbers:

- **prefill**: a P serves S seconds per transfer, S = the P pool's busy time (per P, the
  union of its transfers' compute-and-push spans: vLLM interleaves their chunks) ÷ transfers;
  transfers arrive at λ = transfers / window. A transfer's measured wait for P is its
  ``prefill_queue`` above the stage's 10th percentile (the hop to P) plus the part of its
  ``prefill_compute`` beyond S (other transfers' chunks). With c P the wait is Erlang C's
  M/M/c wait W(c), scaled by k = measured ÷ W(c_now) (within 1/4 … 4; 1 when today's c is
  saturated in the model), so another c moves the mean wait from the measured one to k·W(c).
- **decode**: D's two stages (``binding``: the request waiting for D's blocks;
  ``decode_first_token``: D's next step after the KV landed) are a floor (an unloaded D) plus
  a part that grows with the requests each D carries: with c D that part becomes (c_now / c)
  of today's. The floor is the median of the transfers each D served alone (no other transfer
  at that D between its request and the end of its answer) over the last FLOOR_LOOKBACK_S, or
  the window's 10th percentile when lower or when none was alone: a window of steady load
  holds no unloaded moment, so its own 10th percentile is a loaded D and would hide most of
  what more D gain.

- **inter-token latency** (ITL, ``capacity.breakdown``): D's alone, a floor (its 10th
  percentile, or the median of streams served alone, as for D's stages) plus a part that grows
  with the streams each D carries, (c_now / c) of today's with c D.

The predicted p90 TTFT of a P:D pair of counts is today's p90 moved by both changes, its p90
ITL today's moved by D's. The recommendation is the smallest total that meets the targets
given (TTFT, ITL or both; ties: the fewest changes), or, when they are met already, the
smallest that still meets them with every P below 80% busy; when none meets them, the fewest
instances among those nearest (the largest of the predicted-to-target ratios, smallest). D
is never shrunk: its load shows only through its stages, not how close it is to its limit.
With no target it names the bottleneck only.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from metaserver.capacity.breakdown import DECODE_STAGES, Breakdown, Timeline
from metaserver.capacity.quantile import quantile

BUSY_CAP = 0.8  # a P busier than this queues steeply: never advise shrinking into it
SEARCH = 8  # counts tried: today's − 2 … today's + SEARCH
SCALE_LIMIT = 4.0  # the model is trusted within 4x of what was measured
MODEL_EPSILON_S = 1e-4  # below this the model says "no wait": nothing to scale
NEAR_SHARE, NEAR_RATIO = 0.02, 0.005  # predicted ÷ target this close to the nearest: the same
OVERHEAD_SHARE = 0.25  # disaggregation pays once the exposed push is under this share of compute
FLOOR_LOOKBACK_S = 3600.0  # how far back D's unloaded floor is looked for


def erlang_wait(c: int, offered: float, service_s: float) -> float:
    """Mean wait in queue of M/M/c with ``offered`` = λ·S erlangs (inf when saturated)."""
    if c <= 0 or offered >= c:
        return math.inf
    if offered <= 0:
        return 0.0
    term, total = 1.0, 1.0  # a^k / k!, summed for k < c
    for k in range(1, c):
        term *= offered / k
        total += term
    top = term * offered / c * (c / (c - offered))  # a^c / c! · c / (c − a)
    p_wait = top / (total + top)
    return p_wait * service_s / (c - offered)


@dataclass(frozen=True)
class Pools:
    prefill: int
    decode: int


@dataclass(frozen=True)
class Model:
    breakdown: Breakdown
    now: Pools
    rate: float  # transfers per second
    service_s: float  # P's mean busy time per transfer
    queue_s: float  # measured mean wait for P (see ``of``)
    scale: float  # k: measured ÷ modelled wait at today's count
    decode_floor_s: float
    decode_load_s: float  # today's mean D stage time above its floor
    itl_load_s: float = 0.0  # today's mean ITL above its floor

    @classmethod
    def of(cls, b: Breakdown, now: Pools, history: Sequence[Timeline] = ()) -> Model:
        """``history``: the finished transfers of the last FLOOR_LOOKBACK_S, for D's floor."""
        ts = b.timelines
        # P's own work per transfer: each P's busy time (the union of its transfers' compute
        # and push, which overlap when vLLM interleaves their chunks) over the transfers it ran
        busy = sum(busy_s(spans) for spans in _prefill_spans(ts).values())
        service = busy / len(ts) if ts else 0.0
        rate = len(ts) / b.window_s if b.window_s > 0 else 0.0
        queued = sorted(t.stages["prefill_queue"] for t in ts)
        # waiting for P: the queue stage above its floor (the hop to P), plus the part of the
        # compute stage spent on other transfers' chunks
        waited = (sum(queued) / len(queued) - quantile(queued, 0.1)) if queued else 0.0
        if ts:
            waited += sum(max(0.0, t.stages["prefill_compute"] - service) for t in ts) / len(ts)
        modelled = erlang_wait(now.prefill, rate * service, service)
        scale = 1.0
        if MODEL_EPSILON_S < modelled < math.inf:
            scale = min(SCALE_LIMIT, max(1 / SCALE_LIMIT, waited / modelled))
        alone = served_alone(history)
        d = _decode_times(ts)
        floor = _floor(d, _decode_times(alone))
        load = (sum(d) / len(d) - floor) if d else 0.0
        itl = sorted(i for t in ts if (i := t.itl) is not None)
        itl_floor = _floor(itl, sorted(i for t in alone if (i := t.itl) is not None))
        itl_load = (sum(itl) / len(itl) - itl_floor) if itl else 0.0
        return cls(b, now, rate, service, waited, scale, floor, max(0.0, load), max(0.0, itl_load))

    def busy(self, prefill: int) -> float:
        return self.rate * self.service_s / prefill if prefill > 0 else math.inf

    def prefill_wait(self, prefill: int) -> float:
        return self.scale * erlang_wait(prefill, self.rate * self.service_s, self.service_s)

    def ttft_p90(self, pools: Pools) -> float | None:
        """Today's p90 TTFT moved by the change in mean P wait and D load (None: unknown)."""
        if self.breakdown.ttft is None:
            return None
        p_shift = 0.0  # today's count: today's wait, as measured
        if pools.prefill != self.now.prefill:
            p_shift = self.prefill_wait(pools.prefill) - self.queue_s
        d_shift = self.decode_load_s * (self.now.decode / pools.decode - 1.0)
        return max(0.0, self.breakdown.ttft.p90 + p_shift + d_shift)

    def itl_p90(self, pools: Pools) -> float | None:
        """Today's p90 ITL moved by the change in D load (None: no streamed answer known)."""
        if self.breakdown.itl is None:
            return None
        shift = self.itl_load_s * (self.now.decode / pools.decode - 1.0)
        return max(0.0, self.breakdown.itl.p90 + shift)


def _prefill_spans(ts: list[Timeline]) -> dict[str, list[tuple[float, float]]]:
    """Each P's (start, end) of compute and push per transfer."""
    out: dict[str, list[tuple[float, float]]] = {}
    for t in ts:
        start = t.at - t.stages["push_exposed"] - t.stages["prefill_compute"]
        out.setdefault(t.prefill or "", []).append((start, t.at))
    return out


def busy_s(spans: list[tuple[float, float]]) -> float:
    """The length of the union of ``spans``."""
    total, reach = 0.0, -math.inf
    for start, end in sorted(spans):
        if end > reach:
            total += end - max(start, reach)
            reach = end
    return total


def _floor(window: list[float], alone: list[float]) -> float:
    """An unloaded D's time: the median of those served alone, or the window's 10th percentile
    when lower or when none was alone (both sorted)."""
    floor = quantile(window, 0.1) if window else 0.0
    return min(floor, quantile(alone, 0.5)) if alone else floor


def served_alone(ts: Sequence[Timeline]) -> list[Timeline]:
    """The transfers whose D served no other of ``ts`` from their request to their end."""
    by_d: dict[str, list[Timeline]] = {}
    for t in ts:
        if t.span is not None:
            by_d.setdefault(t.decode, []).append(t)
    out = []
    for group in by_d.values():
        group.sort(key=lambda t: t.span or (0.0, 0.0))
        reach = -math.inf  # the latest end among those that started earlier
        for i, t in enumerate(group):
            assert t.span is not None
            start, end = t.span
            nxt = group[i + 1].span if i + 1 < len(group) else None
            if reach <= start and (nxt is None or nxt[0] >= end):
                out.append(t)
            reach = max(reach, end)
    return out


def _decode_times(ts: Sequence[Timeline]) -> list[float]:
    """Each transfer's time in D's stages, sorted (transfers without the proxy's marks: none)."""
    return sorted(
        sum(t.stages[s] for s in DECODE_STAGES)
        for t in ts
        if all(s in t.stages for s in DECODE_STAGES)
    )


def recommend(
    m: Model, target_p90_s: float | None, itl_target_p90_s: float | None = None
) -> dict[str, Any]:
    b = m.breakdown
    shares = b.shares()
    words = []
    if b.bottleneck is not None:
        words.append(
            f"{b.bottleneck} is {shares[b.bottleneck]:.0%} of the time to first token "
            f"(mean {b.stages[b.bottleneck].mean:.3f} s)"
        )
    words.append(
        f"each P is {m.busy(m.now.prefill):.0%} busy ({m.rate:.2f} transfers/s, "
        f"{m.service_s:.3f} s of P per transfer, {m.now.prefill} P)"
    )
    if b.itl is not None:
        words.append(f"p90 inter-token latency {b.itl.p90 * 1000:.1f} ms")
    out: dict[str, Any] = {
        "now": {"prefill": m.now.prefill, "decode": m.now.decode},
        "prefill_busy": _num(m.busy(m.now.prefill)),
        "target_p90_s": target_p90_s,
        "itl_target_p90_s": itl_target_p90_s,
        "predicted_p90_s": _num(m.ttft_p90(m.now)),
        "predicted_itl_p90_s": _num(m.itl_p90(m.now)),
    }
    targets = _Targets(target_p90_s if m.ttft_p90(m.now) is not None else None, None)
    if itl_target_p90_s is not None and m.itl_p90(m.now) is not None:
        targets = _Targets(targets.ttft, itl_target_p90_s)
    if targets.ttft is not None or targets.itl is not None:
        pools, met = _choose(m, targets)
        out["recommended"] = {"prefill": pools.prefill, "decode": pools.decode}
        out["recommended_p90_s"] = _num(m.ttft_p90(pools))
        out["recommended_itl_p90_s"] = _num(m.itl_p90(pools))
        words.append(
            f"{_change(m.now, pools)}: the model predicts {_predicted(m, pools, targets, met)}"
        )
    if target_p90_s is not None and targets.ttft is None:
        words.append("no TTFT is known (the proxy posts no first_token marks)")
    if itl_target_p90_s is not None and targets.itl is None:
        words.append("no inter-token latency is known (no streamed answer with the proxy's marks)")
    if "recommended" not in out and (target_p90_s is not None or itl_target_p90_s is not None):
        words[-1] += ": no counts"
    out["reasoning"] = "; ".join(words) + "."
    out["disaggregation"] = disaggregation(b, m)
    return out


@dataclass(frozen=True)
class _Targets:
    ttft: float | None  # p90 seconds; None: not asked, or nothing to judge it by
    itl: float | None

    @property
    def both(self) -> bool:
        return self.ttft is not None and self.itl is not None

    def excess(self, m: Model, pools: Pools) -> float:
        """The largest predicted ÷ target: at most 1 when every target is met."""
        worst = 0.0
        for target, predicted in ((self.ttft, m.ttft_p90), (self.itl, m.itl_p90)):
            if target is not None:
                value = predicted(pools)
                assert value is not None
                worst = max(worst, value / target)
        return worst


def _predicted(m: Model, pools: Pools, targets: _Targets, met: bool) -> str:
    """E.g. "p90 TTFT 0.560 s, which meets the target 0.800 s"."""
    said, goals = [], []
    if targets.ttft is not None:
        said.append(f"p90 TTFT {m.ttft_p90(pools):.3f} s")
        goals.append(f"{targets.ttft:.3f} s")
    if targets.itl is not None:
        said.append(f"p90 ITL {(m.itl_p90(pools) or 0.0) * 1000:.1f} ms")
        goals.append(f"{targets.itl * 1000:.1f} ms")
    if targets.both:
        verdict = "meet" if met else "come closest to"
        return f"{' and '.join(said)}, which {verdict} the targets {' and '.join(goals)}"
    verdict = "meets" if met else "comes closest to"
    return f"{said[0]}, which {verdict} the target {goals[0]}"


def _choose(m: Model, targets: _Targets) -> tuple[Pools, bool]:
    candidates = []
    for p in range(max(1, m.now.prefill - 2), m.now.prefill + SEARCH + 1):
        for d in range(m.now.decode, m.now.decode + SEARCH + 1):  # D is never shrunk
            pools = Pools(p, d)
            excess = targets.excess(m, pools)
            shrink_ok = p >= m.now.prefill or m.busy(p) < BUSY_CAP
            changes = (p != m.now.prefill) + (d != m.now.decode)
            candidates.append((excess <= 1.0 and shrink_ok, pools, excess, changes))
    meeting = [c for c in candidates if c[0]]
    if meeting:
        _, pools, _, _ = min(meeting, key=lambda c: (c[1].prefill + c[1].decode, c[3], c[2]))
        return pools, True
    # none meets them: the fewest instances among those within a hair of the nearest
    best = min(c[2] for c in candidates)
    near = [c for c in candidates if c[2] <= best * (1 + NEAR_SHARE) + NEAR_RATIO]
    _, pools, _, _ = min(near, key=lambda c: (c[1].prefill + c[1].decode, c[3], c[2]))
    return pools, False


def _change(now: Pools, to: Pools) -> str:
    parts = []
    for name, a, z in (("P", now.prefill, to.prefill), ("D", now.decode, to.decode)):
        if a != z:
            parts.append(f"{z} {name} instead of {a}")
    return "with " + " and ".join(parts) if parts else "with today's counts"


def disaggregation(b: Breakdown, m: Model) -> dict[str, Any]:
    """Whether pushing KV pays for these prompts, and the ``--disagg-min-tokens`` it suggests:
    the shortest prompt length (a power of two) from which the exposed push stays under
    OVERHEAD_SHARE of P's compute, in the median of every longer length seen."""
    buckets: dict[int, list[Timeline]] = {}
    for t in b.timelines:
        n = max(1, t.prompt_tokens - t.cached_tokens)
        buckets.setdefault(1 << (n.bit_length() - 1), []).append(t)
    pays = {}
    for low, ts in sorted(buckets.items()):
        exposed = sorted(t.stages["push_exposed"] for t in ts)
        compute = sorted(t.stages["prefill_compute"] for t in ts)
        pays[low] = quantile(exposed, 0.5) <= OVERHEAD_SHARE * quantile(compute, 0.5)
    lows = sorted(pays)
    suggest = next((lo for i, lo in enumerate(lows) if all(pays[x] for x in lows[i:])), None)
    idle = m.busy(m.now.prefill) < 0.2
    if not lows:
        text = "no finished transfers in the window"
    elif suggest is None:
        text = "the exposed push is a large part of P's compute at every prompt length seen"
    elif suggest == lows[0]:
        text = "the push is hidden behind P's compute at every prompt length seen"
    else:
        text = f"prompts under {suggest} uncached tokens gain little from P: the push shows"
    if idle and lows:
        text += "; P is mostly idle (under 20% busy)"
    # 0: every length pays; None: none does (or nothing was seen)
    minimum = None if suggest is None else 0 if suggest == lows[0] else suggest
    return {
        "suggested_min_tokens": minimum,
        "pays_by_prompt_tokens": {str(k): v for k, v in pays.items()},
        "prefill_idle": idle,
        "text": text,
    }


def _num(value: float | None) -> float | None:
    return None if value is None or not math.isfinite(value) else round(value, 6)
