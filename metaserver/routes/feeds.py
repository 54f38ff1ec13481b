"""``/v1/feeds/bindings``: new bindings streamed to a proxy as they are created
(``metaserver.feeds``; the line format is ``pdwire.feed``)."""

from __future__ import annotations

import re
from typing import Annotated

from fastapi import APIRouter, Query, Request
from fastapi.responses import StreamingResponse

from metaserver.context import Reader, ctx
from metaserver.errors import Unprocessable
from pdwire.feed import DEFAULT_KEEPALIVE_S, FEED_PATH, MAX_PREFIXES, MEDIA_TYPE, PREFIX_PATTERN

router = APIRouter(tags=["bindings"])


@router.get(
    FEED_PATH,
    response_class=StreamingResponse,
    responses={200: {"content": {MEDIA_TYPE: {}}}, 422: {}},
    summary="Stream the bindings created from now on whose transfer id starts with a ?prefix=",
    description='NDJSON: `{"feed":"live"}` first; then each new binding as `GET '
    '/v1/bindings/{id}` answers it, and `{"feed":"keepalive"}` after ?keepalive= idle seconds; '
    '`{"feed":"lost"}` last when some may have been missed (read those with long-polls).',
)
async def binding_feed(
    request: Request,
    _who: Reader,
    prefix: Annotated[
        list[str],
        Query(description=f"transfer id prefix ({PREFIX_PATTERN}); 1 to {MAX_PREFIXES} of them"),
    ],
    keepalive: Annotated[
        float, Query(ge=0.1, le=60, description="idle seconds between keepalive lines")
    ] = DEFAULT_KEEPALIVE_S,
) -> StreamingResponse:
    c = ctx(request)
    prefixes = tuple(dict.fromkeys(prefix))  # in order, once each
    if not 1 <= len(prefixes) <= MAX_PREFIXES:
        raise Unprocessable(f"prefix: give 1 to {MAX_PREFIXES}, not {len(prefixes)}")
    for p in prefixes:
        if not _PREFIX.fullmatch(p):  # "$" alone would let a trailing newline through
            raise Unprocessable(f"prefix {p[:80]!r} does not match {PREFIX_PATTERN}")
    assert c.feeds is not None
    return StreamingResponse(c.feeds.stream(prefixes, keepalive), media_type=MEDIA_TYPE)


_PREFIX = re.compile(PREFIX_PATTERN)
