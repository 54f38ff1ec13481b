"""Prometheus metrics of one metaserver app (own registry: several apps can share a process)."""

from __future__ import annotations

import time
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from pdwire.asgi import ASGIApp, Message, Receive, Scope, Send

# sub-millisecond resolution: a binding write is ~1 ms end to end, and its tail is what matters
_BUCKETS = (
    0.00025, 0.0005, 0.00075, 0.001, 0.0015, 0.002, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25,
    0.5, 1, 2.5, 5, 10, 30, 60,
)  # fmt: skip


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter(
            "pdgate_metaserver_requests_total",
            "HTTP requests by route and status",
            ["method", "route", "status"],
            registry=self.registry,
        )
        self.latency = Histogram(
            "pdgate_metaserver_request_seconds",
            "HTTP request latency (long-polls included)",
            ["method", "route"],
            buckets=_BUCKETS,
            registry=self.registry,
        )
        self.bindings_created = Counter(
            "pdgate_metaserver_bindings_created_total", "bindings created", registry=self.registry
        )
        self.events = Counter(
            "pdgate_metaserver_binding_events_total",
            "binding state events applied",
            ["state"],
            registry=self.registry,
        )
        self.marks = Counter(
            "pdgate_metaserver_binding_marks_total",
            "binding marks received (first_token, end)",
            ["mark"],
            registry=self.registry,
        )
        self.store_errors = Counter(
            "pdgate_metaserver_store_unavailable_total",
            "requests answered 503 because the store was unreachable",
            registry=self.registry,
        )
        self.waiters = Gauge(
            "pdgate_metaserver_long_polls", "long-polls in progress", registry=self.registry
        )


class MetricsMiddleware:
    """Counts requests per route template (never per raw path: bounded label cardinality)."""

    def __init__(self, app: ASGIApp, metrics: Metrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        start = time.perf_counter()
        status = 500

        async def send_wrapper(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_wrapper)
        finally:
            route: Any = scope.get("route")
            name = getattr(route, "path", "unmatched")
            method = scope["method"]
            self.metrics.requests.labels(method, name, str(status)).inc()
            self.metrics.latency.labels(method, name).observe(time.perf_counter() - start)
