"""The connector's metrics: what each series means, and the counters that collect them.

vLLM carries connector stats as *deltas*: after every step each worker's (and the scheduler
half's) ``get_kv_connector_stats`` hands over what it counted since the previous call and
starts again from zero; vLLM merges the workers' objects (``aggregate``), ships the merged
``to_dict()`` to the API process, and there ``build_prom_metrics``'s object adds each delta to
the engine's own ``/metrics`` (connector/prom.py). So everything here is a plain delta:

* a counter (optionally split by one label) adds up;
* a histogram is the list of this interval's observations, concatenated;
* a gauge travels as its *change* (``blocks_held``), added up like a counter and applied with
  ``inc`` — a gauge's absolute value could not be merged across workers and intervals.

``SERIES`` is the one table of names, kinds, labels and meanings: the Prometheus side,
docs/observability.md and the dashboard test all read it. No vLLM import here (the stats are
counted on hot threads and tested without an engine).
"""

from __future__ import annotations

import enum
import threading
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

PREFIX = "vllm:pdgate_"

StatsData = dict[str, Any]  # key -> float | {label value: float} | [observations]


class Kind(enum.Enum):
    COUNTER = "counter"
    GAUGE = "gauge"  # carried as deltas
    HISTOGRAM = "histogram"


SECONDS_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


@dataclass(frozen=True, slots=True)
class Series:
    key: str  # the key in the stats dict
    kind: Kind
    doc: str
    label: str | None = None  # one extra label after vLLM's model_name and engine
    values: tuple[str, ...] = ()  # the label's values, created at 0 when metrics start
    buckets: tuple[float, ...] = SECONDS_BUCKETS
    side: str = ""  # who counts it: "P worker", "D worker", "D scheduler", ...

    @property
    def name(self) -> str:
        """The name given to prometheus_client (which adds ``_total`` to counters)."""
        return PREFIX + self.key

    @property
    def exposed(self) -> tuple[str, ...]:
        """The series names as they appear on ``/metrics``."""
        if self.kind is Kind.COUNTER:
            return (self.name + "_total",)
        if self.kind is Kind.HISTOGRAM:
            return tuple(self.name + s for s in ("_bucket", "_sum", "_count"))
        return (self.name,)


FAILURE_CAUSES = (
    "timeout",
    "prefill_silent",
    "prefill_failed",
    "corrupt",
    "unverified",
    "binding_rejected",
)

SERIES: tuple[Series, ...] = (
    Series("push_bytes", Kind.COUNTER, "Bytes P wrote into D's KV blocks.", side="P worker"),
    Series("push_pieces", Kind.COUNTER, "Byte runs (pieces) P wrote.", side="P worker"),
    Series(
        "push_writes", Kind.COUNTER, "Batched transport writes that succeeded.", side="P worker"
    ),
    Series(
        "write_retries",
        Kind.COUNTER,
        "Batched writes that failed and were sent again (write_retries).",
        side="P worker",
    ),
    Series(
        "write_retries_skipped",
        Kind.COUNTER,
        "Failed writes not retried because their D is gone (its side channel refuses connections).",
        side="P worker",
    ),
    Series(
        "write_failures",
        Kind.COUNTER,
        "Batched writes that failed after every retry (their transfers fail).",
        side="P worker",
    ),
    Series(
        "transfers",
        Kind.COUNTER,
        "Transfers P ended by signalling D: ok (done) or failed.",
        label="outcome",
        values=("ok", "failed"),
        side="P worker",
    ),
    Series(
        "push_seconds",
        Kind.HISTOGRAM,
        "Per transfer that ended ok: time its batched writes took (all chunks, all layers).",
        side="P worker",
    ),
    Series(
        "push_exposed_seconds",
        Kind.HISTOGRAM,
        "Per transfer that ended ok: write time after P's compute ended (D waited for it).",
        side="P worker",
    ),
    Series(
        "handshakes",
        Kind.COUNTER,
        "Handshakes with D ranks: ok, or failed (unreachable, refused, unpairable).",
        label="result",
        values=("ok", "failed"),
        side="P worker",
    ),
    Series(
        "late_landing_holds",
        Kind.COUNTER,
        "Transfers whose blocks were held because a failed write may still land: P holds its "
        "source blocks (when a retry then succeeded), D its destination blocks, for the "
        "transport's late-landing time.",
        label="side",
        values=("prefill", "decode"),
        side="P and D worker",
    ),
    Series(
        "recv_bytes",
        Kind.COUNTER,
        "Bytes of KV that landed in D's blocks (blocks loaded x D's bytes per block).",
        side="D worker",
    ),
    Series("recv_blocks", Kind.COUNTER, "KV blocks loaded from P.", side="D worker"),
    Series("loads", Kind.COUNTER, "Remote KV loads that completed intact.", side="D worker"),
    Series(
        "late_arrivals",
        Kind.COUNTER,
        "Loads whose KV matched P's digests only after the done signal (writes that finish "
        "before they land; needs digests).",
        side="D worker",
    ),
    Series(
        "load_failures",
        Kind.COUNTER,
        "Remote KV loads that failed, by cause: timeout (no done signal by kv_load_timeout_s), "
        "prefill_silent (P's keep-alives stopped for silence_s: killed or frozen), "
        "prefill_failed (P signalled failure), corrupt (digests did not match), "
        "unverified (digests missing or incomplete, so the KV could not be checked), "
        "binding_rejected (the metaserver refused D's binding, or D's write queue was full).",
        label="cause",
        values=FAILURE_CAUSES,
        side="D worker",
    ),
    Series(
        "blocks_pushed",
        Kind.COUNTER,
        "KV blocks of loads that landed intact, by the P instance that pushed them (its "
        "registry id; 'unknown' from a P that does not name itself): with blocks_recomputed, "
        "how much of each pair's prompts D received and how much it computed itself (each of "
        "D's TP ranks counts its blocks, so both are summed over the ranks).",
        label="prefill",
        side="D worker",
    ),
    Series(
        "blocks_recomputed",
        Kind.COUNTER,
        "KV blocks of failed loads that D computed itself (kv_load_failure_policy=recompute), "
        "by the P instance the load waited for ('none': no P ever signalled).",
        label="prefill",
        side="D worker",
    ),
    Series(
        "recomputes",
        Kind.COUNTER,
        "Failed loads vLLM recomputes locally (kv_load_failure_policy=recompute).",
        side="D worker",
    ),
    Series(
        "binding_write_seconds",
        Kind.HISTOGRAM,
        "D's binding PUT: from scheduling to the metaserver's answer (queue wait included).",
        side="D scheduler",
    ),
    Series(
        "kv_ready_wait_seconds",
        Kind.HISTOGRAM,
        "Per load that ended intact: from its KV being all there on D's worker (P's last done "
        "signal) to the request's first scheduled step (the worker's next poll, the engine's "
        "step in progress).",
        buckets=(0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5),
        side="D scheduler",
    ),
    Series(
        "binding_writes",
        Kind.COUNTER,
        "D's binding PUTs by result: ok, rejected (4xx), error (unreachable, 5xx), dropped "
        "(write queue full).",
        label="result",
        values=("ok", "rejected", "error", "dropped"),
        side="D scheduler",
    ),
    Series(
        "pairing_refusals",
        Kind.COUNTER,
        "Bindings P refused before computing, so it pushed nothing (D recomputes), by why: "
        "protocol (versions), layout (block size or TP pairing), identity (other weights, "
        "dtypes or KV shape registered by D), revision (D of another revision). Any rise is "
        "a deployment error: prefill work done twice.",
        label="reason",
        values=("protocol", "layout", "identity", "revision"),
        side="P scheduler",
    ),
    Series(
        "blocks_held",
        Kind.GAUGE,
        "KV blocks held now for pushes in flight: on P a finished request's source blocks "
        "until its pushes end, on D the blocks waiting for P's KV.",
        label="side",
        values=("prefill", "decode"),
        side="P and D scheduler",
    ),
)

BY_KEY: dict[str, Series] = {s.key: s for s in SERIES}


def exposed_names() -> set[str]:
    """Every connector series name an engine's ``/metrics`` carries."""
    return {name for s in SERIES for name in s.exposed}


# ---- the delta dicts ------------------------------------------------------------------------
def merge(into: StatsData, other: Mapping[str, Any]) -> StatsData:
    """Add ``other``'s deltas to ``into`` (in place) and return it."""
    for key, value in other.items():
        kind = BY_KEY[key].kind if key in BY_KEY else None
        if kind is Kind.HISTOGRAM:
            into.setdefault(key, []).extend(value)
        elif isinstance(value, Mapping):
            mine = into.setdefault(key, {})
            for label, v in value.items():
                mine[label] = mine.get(label, 0) + v
        elif kind is not None:
            into[key] = into.get(key, 0) + value
    return into


def is_empty(data: Mapping[str, Any]) -> bool:
    """Nothing to report: no key, or only zeros and empty lists."""
    for value in data.values():
        if isinstance(value, Mapping):
            if any(value.values()):
                return False
        elif value:
            return False
    return True


def reduce(data: Mapping[str, Any]) -> dict[str, int | float]:
    """One interval's summary for vLLM's log line (``KV Transfer metrics: ...``)."""
    out: dict[str, int | float] = {}
    for key, value in data.items():
        if isinstance(value, Mapping):
            for label, v in sorted(value.items()):
                if v:
                    out[f"{key}[{label}]"] = v
        elif isinstance(value, list):
            if value:
                out[f"{key}_count"] = len(value)
                out[f"{key}_avg_ms"] = round(sum(value) / len(value) * 1e3, 3)
        elif value:
            out[key] = value
    return out


class StatsCollector:
    """Thread-safe deltas: the forward thread, the sender thread, the handshake pool and the
    metaserver writer's threads all count into one; ``take`` hands them over and resets."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._data: StatsData = {}

    def add(self, key: str, amount: float = 1, label: str | None = None) -> None:
        with self._lock:
            if label is None:
                self._data[key] = self._data.get(key, 0) + amount
            else:
                by = self._data.setdefault(key, {})
                by[label] = by.get(label, 0) + amount

    def observe(self, key: str, value: float) -> None:
        with self._lock:
            self._data.setdefault(key, []).append(value)

    def take(self) -> StatsData | None:
        """The deltas since the last ``take`` (``None`` when there are none)."""
        with self._lock:
            data, self._data = self._data, {}
        return None if is_empty(data) else data
