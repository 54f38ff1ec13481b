"""The breakdown and the P:D advice as the metaserver serves them (``GET /v1/breakdown``) and
exports them (``pdgate_metaserver_pool_recommended``), from its store's recent bindings."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from metaserver.capacity.advice import FLOOR_LOOKBACK_S, Model, Pools, recommend
from metaserver.capacity.breakdown import Breakdown, Timeline, timeline_of
from metaserver.context import Context
from pdwire.models import BindingState

log = logging.getLogger("pdgate.metaserver.advice")


async def pools(c: Context) -> Pools:
    """Registered instances per pool (``both`` counts in each)."""
    roles = [i.role for i in await c.store.list_instances(None)]
    both = roles.count("both")
    return Pools(roles.count("prefill") + both, roles.count("decode") + both)


async def advise(
    c: Context, window_s: float, target_p90_s: float | None, itl_target_p90_s: float | None = None
) -> dict[str, Any]:
    now = c.clock()
    records = await c.store.list_bindings(
        state=BindingState.DONE, instance_id=None, limit=c.settings.stats_scan_limit
    )
    timelines: list[Timeline] = []  # the window's
    history: list[Timeline] = []  # FLOOR_LOOKBACK_S's (or the window's, when longer)
    for record in records:
        if record.updated_at < now - max(window_s, FLOOR_LOOKBACK_S):
            continue
        t = timeline_of(record)
        if t is None:
            continue
        history.append(t)
        if record.updated_at >= now - window_s:
            timelines.append(t)
    b = Breakdown.of(timelines, window_s)
    counts = await pools(c)
    out = b.json()
    if timelines and counts.prefill and counts.decode:
        out["advice"] = recommend(Model.of(b, counts, history), target_p90_s, itl_target_p90_s)
    else:
        out["advice"] = None
    return out


async def refresh_once(c: Context) -> None:
    """Set the pool gauges from the advice for the configured targets. Only this writes them:
    a reader's ``GET /v1/breakdown?ttft_p90=…`` computes its own advice and moves nothing (the
    gauges feed autoscalers)."""
    s = c.settings
    advice = (await advise(c, s.advice_window_s, s.ttft_target_p90_s, s.itl_target_p90_s))["advice"]
    if advice is not None and "recommended" in advice:
        for pool in ("prefill", "decode"):
            c.metrics.pool_recommended.labels(pool).set(advice["recommended"][pool])
            c.metrics.pool_current.labels(pool).set(advice["now"][pool])


async def refresh(c: Context) -> None:
    """Keep the pool gauges current (``--ttft-target``, ``--itl-target``): one advice every
    interval."""
    while True:
        try:
            await refresh_once(c)
        except Exception as exc:  # a store outage: the gauges keep their last values
            log.warning("P:D advice not refreshed: %s", exc)
        await asyncio.sleep(c.settings.advice_interval_s)
