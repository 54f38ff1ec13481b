"""Where the time to first token goes, from the bindings of a recent window.

A finished decode-first binding is a timeline: the proxy got the request (``first_token``
mark minus its ``since_request_s``), D bound its blocks (``bound``), P took the transfer
(``prefill_started``), P's compute ended (``done`` minus the ``tail_s`` of its summary), the
last byte landed and D was told (``done``), the proxy got D's first token (``first_token``).
Consecutive moments give five stages that add up to the TTFT:

==================  =======================================================  =============
stage               from → to                                                charged to
==================  =======================================================  =============
binding             request at the proxy → D bound its blocks                 decode
prefill_queue       D bound → P took the transfer (proxy → P, P's queue)      prefill
prefill_compute     P took it → P's compute ended                             prefill
push_exposed        P's compute ended → KV landed in D (the unhidden push)    prefill
decode_first_token  KV landed → the proxy had D's first token                 decode
==================  =======================================================  =============

Without the proxy's marks (``--binding-marks``) the first and last stages are unknown: the
breakdown then says so and covers the three in the middle.

A streamed answer's inter-token latency (ITL) is its mean gap between tokens: from the
``first_token`` mark to the ``end`` mark over the chunks D sent in between (the ``end`` mark's
``chunks``, less the first and ``[DONE]``; vLLM flushes one event per token). Answers that
ended otherwise than ``ok``, or with fewer than two tokens, have none.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import msgspec

from metaserver.capacity.quantile import quantile
from metaserver.store.records import StoredBinding
from pdwire import push_summary

STAGES = ("binding", "prefill_queue", "prefill_compute", "push_exposed", "decode_first_token")
PREFILL_STAGES = ("prefill_queue", "prefill_compute", "push_exposed")
DECODE_STAGES = ("binding", "decode_first_token")


class _Detail(msgspec.Struct):
    message: str | None = None
    since_request_s: float | None = None
    outcome: str | None = None
    chunks: int | None = None


class _Moment(msgspec.Struct):
    at: float
    actor: str = ""
    state: str | None = None
    mark: str | None = None
    detail: _Detail | None = None


class _Spec(msgspec.Struct):
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0


_moment = msgspec.json.Decoder(_Moment)
_spec = msgspec.json.Decoder(_Spec)


@dataclass(frozen=True, slots=True)
class Timeline:
    """One transfer's stages in seconds (a stage that cannot be told is absent)."""

    transfer_id: str
    decode: str
    prefill: str | None
    stages: dict[str, float]
    prompt_tokens: int
    cached_tokens: int
    at: float  # when it finished (done)
    itl: float | None = None  # mean seconds between its streamed tokens
    # at D, from the request reaching the proxy to the end of its answer (the end mark; else
    # the first token's); None without the proxy's marks
    span: tuple[float, float] | None = None

    @property
    def ttft(self) -> float | None:
        return sum(self.stages.values()) if len(self.stages) == len(STAGES) else None


def timeline_of(b: StoredBinding) -> Timeline | None:
    """The stages of a ``done`` binding (None for any other, or one missing P's moments)."""
    events = [_moment.decode(e) for e in b.events]
    at = {e.state: e for e in events if e.state}
    started, done = at.get("prefill_started"), at.get("done")
    if b.state.value != "done" or started is None or done is None:
        return None
    tail = push_summary.parse(done.detail.message if done.detail else None).get("tail_s", 0.0)
    compute_end = min(max(done.at - tail, started.at), done.at)
    stages = {
        "prefill_queue": max(0.0, started.at - b.created_at),
        "prefill_compute": compute_end - started.at,
        "push_exposed": done.at - compute_end,
    }
    marks = {m.mark: m for m in (_moment.decode(x) for x in b.marks)}
    first, end = marks.get("first_token"), marks.get("end")
    since = first.detail.since_request_s if first and first.detail else None
    span = None
    if first is not None and since is not None:
        requested = first.at - since
        stages["binding"] = max(0.0, b.created_at - requested)
        stages["decode_first_token"] = max(0.0, first.at - done.at)
        span = (requested, max(first.at, end.at if end is not None else first.at))
    spec = _spec.decode(b.spec_json)
    return Timeline(
        b.transfer_id,
        b.decode_instance_id,
        started.actor or None,
        {s: stages[s] for s in STAGES if s in stages},
        spec.num_prompt_tokens,
        spec.num_cached_tokens,
        done.at,
        _itl(first, end),
        span,
    )


def _itl(first: _Moment | None, end: _Moment | None) -> float | None:
    if first is None or end is None or end.detail is None or end.detail.outcome != "ok":
        return None
    gaps = (end.detail.chunks or 0) - 2  # the first token's chunk and [DONE]'s
    return (end.at - first.at) / gaps if gaps > 0 and end.at >= first.at else None


@dataclass
class Spread:
    count: int
    mean: float
    p50: float
    p90: float

    @classmethod
    def of(cls, values: Iterable[float]) -> Spread | None:
        v = sorted(values)
        if not v:
            return None
        return cls(len(v), sum(v) / len(v), quantile(v, 0.5), quantile(v, 0.9))

    def json(self) -> dict[str, Any]:
        return {
            "count": self.count,
            "mean_s": round(self.mean, 6),
            "p50_s": round(self.p50, 6),
            "p90_s": round(self.p90, 6),
        }


@dataclass
class Breakdown:
    window_s: float
    timelines: list[Timeline]
    stages: dict[str, Spread] = field(default_factory=dict)
    ttft: Spread | None = None
    itl: Spread | None = None

    @classmethod
    def of(cls, timelines: list[Timeline], window_s: float) -> Breakdown:
        out = cls(window_s, timelines)
        for stage in STAGES:
            spread = Spread.of(t.stages[stage] for t in timelines if stage in t.stages)
            if spread is not None:
                out.stages[stage] = spread
        out.ttft = Spread.of(t for x in timelines if (t := x.ttft) is not None)
        out.itl = Spread.of(i for x in timelines if (i := x.itl) is not None)
        return out

    @property
    def missing(self) -> list[str]:
        return [s for s in STAGES if s not in self.stages]

    def shares(self) -> dict[str, float]:
        """Each known stage's part of the sum of the known stages' means."""
        total = sum(s.mean for s in self.stages.values())
        if total <= 0:
            return {}
        return {name: s.mean / total for name, s in self.stages.items()}

    @property
    def bottleneck(self) -> str | None:
        shares = self.shares()
        return max(shares, key=lambda s: shares[s]) if shares else None

    def per_instance(self) -> dict[str, dict[str, Any]]:
        """Each instance's own stages: P's for a prefill, D's for a decode."""
        groups: dict[tuple[str, str], list[Timeline]] = {}
        for t in self.timelines:
            groups.setdefault(("decode", t.decode), []).append(t)
            if t.prefill is not None:
                groups.setdefault(("prefill", t.prefill), []).append(t)
        out: dict[str, dict[str, Any]] = {}
        for (role, name), ts in sorted(groups.items()):
            own = PREFILL_STAGES if role == "prefill" else DECODE_STAGES
            stages = {}
            for stage in own:
                spread = Spread.of(t.stages[stage] for t in ts if stage in t.stages)
                if spread is not None:
                    stages[stage] = spread.json()
            out[name] = {"role": role, "transfers": len(ts), "stages": stages}
            if role == "decode":
                itl = Spread.of(i for t in ts if (i := t.itl) is not None)
                out[name]["itl"] = None if itl is None else itl.json()
        return out

    def json(self) -> dict[str, Any]:
        shares = self.shares()
        return {
            "window_s": self.window_s,
            "transfers": len(self.timelines),
            "ttft": None if self.ttft is None else self.ttft.json(),
            "itl": None if self.itl is None else self.itl.json(),
            "stages": {
                name: {**s.json(), "share": round(shares.get(name, 0.0), 4)}
                for name, s in self.stages.items()
            },
            "missing_stages": self.missing,
            "bottleneck": self.bottleneck,
            "instances": self.per_instance(),
        }
