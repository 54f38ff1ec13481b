"""Operations: ``/health``, ``/ready``, ``/metrics`` (open to probes and scrapers) and
``/v1/stats``."""

from __future__ import annotations

import time

from fastapi import APIRouter, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from metaserver.access.callers import Reader
from metaserver.capacity.quantile import quantile
from metaserver.context import Ctx
from metaserver.errors import StoreUnavailable
from pdwire.models import BindingState, Stats

router = APIRouter(tags=["operations"])


@router.get("/health", summary="The process is up (does not touch the store)")
async def health() -> dict[str, str]:
    return {"status": "ok"}


@router.get("/ready", summary="The store answers; 503 otherwise", responses={503: {}})
async def ready(c: Ctx) -> dict[str, str]:
    await c.store.ping()
    return {"status": "ready", "store": c.store.description}


@router.get("/metrics", summary="Prometheus metrics")
async def metrics(c: Ctx) -> Response:
    now = time.monotonic()
    # /metrics answers anyone (scrapers carry no token): its scan of the newest bindings for the
    # in-flight gauges runs at most every --metrics-scan-interval, however often it is asked
    if now - c.metrics.open_scanned_at >= c.settings.metrics_scan_interval_s:
        c.metrics.open_scanned_at = now
        try:
            open_ = await c.store.open_transfers(c.settings.stats_scan_limit)
        except StoreUnavailable:
            pass  # the other series still go out; the in-flight gauges keep their last reading
        else:
            c.metrics.set_open(open_.by_state, open_.oldest_created_at, c.clock())
    return Response(generate_latest(c.metrics.registry), media_type=CONTENT_TYPE_LATEST)


@router.get("/v1/stats", response_model=Stats, summary="Bindings by state, bound→done latency")
async def stats(c: Ctx, _who: Reader) -> Stats:
    raw = await c.store.stats(c.settings.stats_scan_limit)
    lat = sorted(x * 1000 for x in raw.done_latencies_s)
    pct: dict[str, float | None] = {}
    for name, q in (("p50", 0.5), ("p90", 0.9), ("p99", 0.99)):
        pct[name] = round(quantile(lat, q), 3) if lat else None
    return Stats(
        bindings_by_state={s.value: raw.by_state.get(s.value, 0) for s in BindingState},
        bindings_scanned=raw.scanned,
        bound_to_done_ms=pct,
        bound_to_done_samples=len(lat),
        instances_by_role=raw.instances_by_role,
    )
