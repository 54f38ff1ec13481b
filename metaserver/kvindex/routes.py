"""The KV-event index's HTTP edge: ``POST /v1/kv/match`` and ``/v1/kv/placed`` (proxies) and
``GET /v1/kv`` (operators)."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request, Response

from metaserver.access.callers import KVAsker, LoadSharer, Reader
from metaserver.context import Ctx
from metaserver.kvindex.index import Placement
from metaserver.openapi import json_body
from metaserver.validation import parse_body
from pdwire.models import KV_MATCH_PATH, KV_PLACED_PATH, KVMatchIn, KVMatchOut, KVPlacedIn

router = APIRouter(tags=["kv index"])


@router.post(
    KV_MATCH_PATH,
    response_model=KVMatchOut,
    responses={401: {}, 403: {}, 422: {}},
    openapi_extra=json_body(KVMatchIn, write=False),
    summary="Per instance: how many of a prompt's first blocks its prefix cache holds",
)
async def match(request: Request, c: Ctx, _who: KVAsker) -> dict[str, Any]:
    body = parse_body(KVMatchIn, await request.body())
    streams = await c.kv_streams.ids()
    asked = list(dict.fromkeys(body.instances))
    known = [i for i in asked if i in streams]  # the others: 0, without a lookup
    found = await c.kv_index.match(body.keys, known, placed=body.placed) if known else {}
    return {"matched": {i: found.get(i, 0) for i in asked}}


@router.post(
    KV_PLACED_PATH,
    status_code=204,
    responses={401: {}, 403: {}, 422: {}},
    openapi_extra=json_body(KVPlacedIn),
    summary="Prompts a proxy just sent: their blocks count as held there for a few seconds",
)
async def placed(request: Request, c: Ctx, _who: LoadSharer) -> Response:
    body = parse_body(KVPlacedIn, await request.body())
    streams = await c.kv_streams.ids()  # placements elsewhere would only be kept, never asked
    kept = [Placement(p.instance, p.keys) for p in body.placed if p.instance in streams]
    if kept:
        await c.kv_index.place(kept)
    return Response(status_code=204)


@router.get("/v1/kv", summary="The KV-event index: blocks per instance, each stream's state")
async def state(c: Ctx, _who: Reader) -> dict[str, Any]:
    index = c.kv_index
    sizes = await index.sizes()
    manager = c.kv_events
    streams: dict[str, Any] = {}
    if manager is not None:
        for f in manager.followers:
            st = f.stats
            streams[f.instance_id] = {
                "endpoint": f.source.endpoint,
                "batches": st.batches,
                "last_seq": st.last_seq,
                "skipped": st.skipped,
                "replays": st.replays,
                "rebuilds": st.rebuilds,
                "bad_batches": st.bad,
            }
    return {
        "index": index.description,
        "following": manager is not None and manager.leading,
        "blocks": sizes,
        "dropped_stores": index.dropped,
        "streams": streams,
    }
