"""The KV-event index: ``POST /v1/kv/match`` (proxies) and ``GET /v1/kv`` (operators)."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request

from metaserver.context import ctx
from metaserver.validation import parse_body
from pdwire.models import KV_MATCH_PATH, KVMatchIn, KVMatchOut

router = APIRouter(tags=["kv index"])


@router.post(
    KV_MATCH_PATH,
    response_model=KVMatchOut,
    responses={422: {}},
    openapi_extra={
        "requestBody": {
            "required": True,
            "content": {"application/json": {"schema": {"$ref": "#/components/schemas/KVMatchIn"}}},
        }
    },
    summary="Per instance: how many of a prompt's first blocks its prefix cache holds",
)
async def match(request: Request) -> dict[str, Any]:
    c = ctx(request)
    c.authorize(request.headers.get("authorization"), write=False)
    body = parse_body(KVMatchIn, await request.body())
    return {"matched": await c.store.kv_index().match(body.keys, body.instances)}


@router.get("/v1/kv", summary="The KV-event index: blocks per instance, each stream's state")
async def state(request: Request) -> dict[str, Any]:
    c = ctx(request)
    c.authorize(request.headers.get("authorization"), write=False)
    index = c.store.kv_index()
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
