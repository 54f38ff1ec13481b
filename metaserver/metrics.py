"""Prometheus metrics of one metaserver app (own registry: several apps can share a process)."""

from __future__ import annotations

import time
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from pdservice.asgi import ASGIApp, Message, Receive, Scope, Send
from pdwire.models import BindingState

# sub-millisecond resolution: a binding write is ~1 ms end to end, and its tail is what matters
_BUCKETS = (
    0.00025, 0.0005, 0.00075, 0.001, 0.0015, 0.002, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25,
    0.5, 1, 2.5, 5, 10, 30, 60,
)  # fmt: skip


# P/D phases: milliseconds to minutes
_PHASE_BUCKETS = (
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300,
)  # fmt: skip

OPEN_STATES = tuple(s.value for s in BindingState if not s.terminal)


class Metrics:
    def __init__(self) -> None:
        self.open_scanned_at = float("-inf")  # monotonic time of the last in-flight scan
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
        self.pool_recommended = Gauge(
            "pdgate_metaserver_pool_recommended",
            "instances the P:D advice recommends per pool for --ttft-target (GET /v1/breakdown)",
            ["pool"],
            registry=self.registry,
        )
        self.pool_current = Gauge(
            "pdgate_metaserver_pool_current",
            "instances registered per pool when the advice was made",
            ["pool"],
            registry=self.registry,
        )
        self.batch_calls = Histogram(
            "pdgate_metaserver_batch_calls",
            "writes per POST /v1/batch",
            buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256),
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
        self.ascend_refused = Counter(
            "pdgate_metaserver_ascend_refused_total",
            "vllm-ascend bindings refused: remote_host:remote_port outside the decode pool",
            registry=self.registry,
        )
        self.waiters = Gauge(
            "pdgate_metaserver_long_polls", "long-polls in progress", registry=self.registry
        )
        self.feeds = Gauge(
            "pdgate_metaserver_binding_feeds", "binding feeds open", registry=self.registry
        )
        self.feed_lines = Counter(
            "pdgate_metaserver_binding_feed_lines_total",
            "bindings sent down binding feeds",
            registry=self.registry,
        )
        self.feeds_lost = Counter(
            "pdgate_metaserver_binding_feeds_lost_total",
            "binding feeds ended with 'lost' (store reconnect or a reader too slow)",
            registry=self.registry,
        )
        # P/D signals (docs/kubernetes.md: autoscaling inputs)
        self.prefill_queue = Histogram(
            "pdgate_metaserver_prefill_queue_seconds",
            "from D's binding to P starting the prefill (its first prefill_started or pushing "
            "event): P's queueing, plus the proxy's hop to P",
            buckets=_PHASE_BUCKETS,
            registry=self.registry,
        )
        self.transfer_seconds = Histogram(
            "pdgate_metaserver_transfer_seconds",
            "from D's binding to the transfer's end, by outcome (done, failed, aborted)",
            ["outcome"],
            buckets=_PHASE_BUCKETS,
            registry=self.registry,
        )
        self.in_flight = Gauge(
            "pdgate_metaserver_transfers_in_flight",
            "bindings not done, failed or aborted yet, by state (read from the store at "
            "scrape time, among the newest stats_scan_limit)",
            ["state"],
            registry=self.registry,
        )
        self.oldest_age = Gauge(
            "pdgate_metaserver_transfer_oldest_age_seconds",
            "age of the oldest binding in flight (0: none)",
            registry=self.registry,
        )
        for state in OPEN_STATES:
            self.in_flight.labels(state)

    def observe_event(
        self, state: BindingState, created_at: float, events: int, now: float
    ) -> None:
        """An event was applied to a binding (``events``: how many it has now)."""
        if state.terminal:
            self.transfer_seconds.labels(state.value).observe(max(0.0, now - created_at))
        elif events == 2 and state in (BindingState.PREFILL_STARTED, BindingState.PUSHING):
            self.prefill_queue.observe(max(0.0, now - created_at))  # the first after bound

    def set_open(
        self, by_state: dict[str, int], oldest_created_at: float | None, now: float
    ) -> None:
        for state in OPEN_STATES:
            self.in_flight.labels(state).set(by_state.get(state, 0))
        age = 0.0 if oldest_created_at is None else max(0.0, now - oldest_created_at)
        self.oldest_age.set(age)


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
