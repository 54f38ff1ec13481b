"""The connector's stats as vLLM's ``KVConnectorStats``, and their Prometheus series.

``PdgateStats`` wraps one delta dict (connector/stats.py): vLLM merges the workers' objects with
``aggregate``, sends ``to_dict()`` to the API process, rebuilds it there with the facade's
``build_kv_connector_stats`` for its log line (``reduce``), and hands the dict to the
``PdgatePromMetrics`` built by ``build_prom_metrics``, which adds it to the engine's own
``/metrics`` with vLLM's labels (``model_name``, ``engine``). Modelled on vLLM 0.32's
``NixlKVConnectorStats`` / ``NixlPromMetrics`` (``kv_connector/v1/nixl/stats.py``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
)
from vllm.v1.metrics.utils import create_metric_per_engine

from connector import stats
from connector.stats import Kind

if TYPE_CHECKING:
    from vllm.config import VllmConfig


@dataclass
class PdgateStats(KVConnectorStats):
    """One interval's deltas (``data``: see connector/stats.py)."""

    def reset(self) -> None:
        self.data = {}

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        stats.merge(self.data, other.data)
        return self

    def reduce(self) -> dict[str, int | float]:
        return stats.reduce(self.data)

    def is_empty(self) -> bool:
        return stats.is_empty(self.data)


class PdgatePromMetrics(KVConnectorPromMetrics):
    """Every series of ``stats.SERIES``, one child per engine (and label value), created at
    start so that each one is on ``/metrics`` from the first scrape."""

    def __init__(
        self,
        vllm_config: VllmConfig,
        metric_types: dict[type[Any], type[Any]],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self._metrics: dict[str, Any] = {}
        counter: Any = self._counter_cls
        histogram: Any = self._histogram_cls
        gauge: Any = self._gauge_cls
        for s in stats.SERIES:
            names = labelnames + ([s.label] if s.label else [])
            metric: Any
            if s.kind is Kind.COUNTER:
                metric = counter(name=s.name, documentation=s.doc, labelnames=names)
            elif s.kind is Kind.HISTOGRAM:
                metric = histogram(
                    name=s.name, documentation=s.doc, labelnames=names, buckets=list(s.buckets)
                )
            else:  # deltas from one engine core: the sum over API processes is the value
                metric = gauge(
                    name=s.name, documentation=s.doc, labelnames=names, multiprocess_mode="sum"
                )
            self._metrics[s.key] = metric
            for values in per_engine_labelvalues.values():  # label values known up front
                for v in s.values if s.label else (None,):
                    metric.labels(*values, *(() if v is None else (v,)))
        self._plain: dict[str, dict[int, Any]] = {
            key: create_metric_per_engine(m, per_engine_labelvalues)
            for key, m in self._metrics.items()
            if stats.BY_KEY[key].label is None
        }

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        values = self.per_engine_labelvalues[engine_idx]
        for key, value in transfer_stats_data.items():
            series = stats.BY_KEY.get(key)
            if series is None:
                continue  # a newer worker's series this API process does not know
            if series.kind is Kind.HISTOGRAM:
                child = self._plain[key][engine_idx]
                for v in value:
                    child.observe(v)
            elif isinstance(value, dict):
                metric = self._metrics[key]
                for label, v in value.items():
                    _add(metric.labels(*values, label), series.kind, v)
            else:
                _add(self._plain[key][engine_idx], series.kind, value)


def _add(child: Any, kind: Kind, amount: float) -> None:
    if kind is Kind.GAUGE:
        child.inc(amount)  # a gauge's delta may be negative
    elif amount > 0:
        child.inc(amount)
