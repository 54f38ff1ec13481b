"""``GET /v1/breakdown``: where the time to first token goes, and what P:D to run."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Query

from metaserver.access.callers import Reader
from metaserver.capacity.advisor import advise
from metaserver.context import Ctx

router = APIRouter(tags=["operations"])


@router.get(
    "/v1/breakdown",
    summary="TTFT split into stages over a recent window, per instance, with P:D advice",
)
async def breakdown(
    c: Ctx,
    _who: Reader,
    window: Annotated[float | None, Query(gt=0, le=86_400, description="seconds back")] = None,
    ttft_p90: Annotated[
        float | None, Query(gt=0, le=3600, description="p90 TTFT target in seconds")
    ] = None,
    itl_p90: Annotated[
        float | None,
        Query(gt=0, le=60, description="p90 inter-token latency target in seconds"),
    ] = None,
) -> dict[str, Any]:
    s = c.settings
    target = ttft_p90 if ttft_p90 is not None else s.ttft_target_p90_s
    itl = itl_p90 if itl_p90 is not None else s.itl_target_p90_s
    return await advise(c, window or s.advice_window_s, target, itl)
