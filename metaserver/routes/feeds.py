"""``/v1/feeds/bindings``: new bindings streamed to a proxy as they are created
(``metaserver.feeds``; the line format is ``pdwire.feed``)."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Query, Request
from fastapi.responses import StreamingResponse

from metaserver.context import ctx
from pdwire.feed import DEFAULT_KEEPALIVE_S, FEED_PATH, MEDIA_TYPE, PREFIX_PATTERN

router = APIRouter(tags=["bindings"])


@router.get(
    FEED_PATH,
    response_class=StreamingResponse,
    responses={200: {"content": {MEDIA_TYPE: {}}}, 422: {}},
    summary="Stream the bindings created from now on whose transfer id starts with ?prefix=",
    description='NDJSON: `{"feed":"live"}` first; then each new binding as `GET '
    '/v1/bindings/{id}` answers it, and `{"feed":"keepalive"}` after ?keepalive= idle seconds; '
    '`{"feed":"lost"}` last when some may have been missed (read those with long-polls).',
)
async def binding_feed(
    request: Request,
    prefix: Annotated[str, Query(pattern=PREFIX_PATTERN, description="transfer id prefix")],
    keepalive: Annotated[
        float, Query(ge=0.1, le=60, description="idle seconds between keepalive lines")
    ] = DEFAULT_KEEPALIVE_S,
) -> StreamingResponse:
    c = ctx(request)
    c.authorize(request.headers.get("authorization"), write=False)
    assert c.feeds is not None
    return StreamingResponse(c.feeds.stream(prefix, keepalive), media_type=MEDIA_TYPE)
