"""Prometheus metrics of the proxy (one registry per app, so tests can build several)."""

from __future__ import annotations

from collections.abc import Callable, Iterable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from proxy.instances import Instance

_LEG_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)


class _InstanceCollector(Collector):
    def __init__(self, instances: Callable[[], Iterable[Instance]]) -> None:
        self._instances = instances

    def collect(self) -> Iterable[GaugeMetricFamily]:
        inflight = GaugeMetricFamily(
            "pd_instance_inflight", "requests in flight per instance", labels=["role", "instance"]
        )
        healthy = GaugeMetricFamily(
            "pd_instance_healthy", "1 if selectable (healthy, circuit closed, not draining)",
            labels=["role", "instance"],
        )  # fmt: skip
        for inst in self._instances():
            inflight.add_metric([inst.role.value, inst.url], inst.inflight)
            healthy.add_metric([inst.role.value, inst.url], 1.0 if inst.available() else 0.0)
        yield inflight
        yield healthy


class Metrics:
    def __init__(self, instances: Callable[[], Iterable[Instance]]) -> None:
        r = self.registry = CollectorRegistry()
        self.requests = Counter(
            "pd_requests_total", "client requests by endpoint, flow and outcome",
            ["endpoint", "flow", "outcome", "status"], registry=r,
        )  # fmt: skip
        self.decisions = Counter(
            "pd_decision_total", "disaggregate or not, and why", ["decision"], registry=r
        )
        self.instance_requests = Counter(
            "pd_instance_requests_total", "legs sent to each instance by outcome",
            ["role", "instance", "outcome"], registry=r,
        )  # fmt: skip
        self.retries = Counter("pd_retries_total", "attempts retried", ["reason"], registry=r)
        self.inflight = Gauge("pd_inflight", "client requests in flight", registry=r)
        self.rejected = Counter("pd_rejected_total", "requests refused", ["reason"], registry=r)
        self.prefill_seconds = Histogram(
            "pd_prefill_seconds", "prefill leg duration", buckets=_LEG_BUCKETS, registry=r
        )
        self.binding_wait_seconds = Histogram(
            "pd_binding_wait_seconds", "time until D's binding was seen", buckets=_LEG_BUCKETS,
            registry=r,
        )  # fmt: skip
        self.decode_ttft_seconds = Histogram(
            "pd_decode_ttft_seconds", "time from sending D to its first byte",
            buckets=_LEG_BUCKETS, registry=r,
        )  # fmt: skip
        self.total_seconds = Histogram(
            "pd_request_seconds", "whole request, client's view", ["flow"], buckets=_LEG_BUCKETS,
            registry=r,
        )  # fmt: skip
        self.events_dropped = Counter(
            "pd_binding_events_dropped_total", "binding events not sent (queue full)", registry=r
        )
        r.register(_InstanceCollector(instances))

    def render(self) -> bytes:
        return generate_latest(self.registry)
