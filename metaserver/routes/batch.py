"""``POST /v1/batch``: several binding writes in one request (``metaserver.batch``)."""

from __future__ import annotations

from fastapi import APIRouter, Request, Response

from metaserver import batch
from metaserver.context import Writer, ctx
from metaserver.responses import json_bytes
from metaserver.routes._openapi import json_body
from pdwire.models import BATCH_PATH, BatchIn, BatchOut

router = APIRouter(tags=["bindings"])


@router.post(
    BATCH_PATH,
    responses={200: {"model": BatchOut}, 422: {}},
    openapi_extra=json_body(BatchIn),
    summary="Several binding writes in one request, each answered as if sent alone",
)
async def post_batch(request: Request, who: Writer) -> Response:
    c = ctx(request)
    reply = await batch.run(c, who, await request.body())
    return json_bytes(reply.body, reply.status)
