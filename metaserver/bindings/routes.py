"""The bindings' HTTP edge, beside what it serves: ``/v1/bindings`` (where prefill must push a
transfer's KV, and its state history), ``POST /v1/batch`` (several binding writes in one
request, ``bindings.batch``) and ``/v1/feeds/bindings`` (new bindings streamed to a proxy as they
are created, ``bindings.feeds``; the line format is ``pdwire.feed``). The hot calls are served
before these routes by ``bindings.fastpath``; both call ``bindings.service``."""

from __future__ import annotations

import re
from typing import Annotated

from fastapi import APIRouter, Depends, Path, Query, Request, Response
from fastapi.responses import StreamingResponse

from metaserver.access.callers import Reader, Writer
from metaserver.bindings import batch, service
from metaserver.context import Ctx
from metaserver.errors import NotFound, Unprocessable
from metaserver.openapi import WRITE, json_body
from metaserver.responses import json_bytes, json_list
from pdwire.feed import DEFAULT_KEEPALIVE_S, FEED_PATH, MAX_PREFIXES, MEDIA_TYPE, PREFIX_PATTERN
from pdwire.ids import TRANSFER_ID_PATTERN
from pdwire.models import (
    BATCH_PATH,
    BatchIn,
    BatchOut,
    Binding,
    BindingSpec,
    BindingState,
    EventIn,
    MarkIn,
)

router = APIRouter(prefix="/v1/bindings", tags=["bindings"])
batch_router = APIRouter(tags=["bindings"])
feed_router = APIRouter(tags=["bindings"])
TransferId = Annotated[str, Path(pattern=TRANSFER_ID_PATTERN)]


async def _deletable(who: Writer, transfer_id: TransferId) -> str:
    """The id of a binding the caller may delete: an admin's call, checked after the id's own
    validation (a malformed id is 422 whoever asks)."""
    who.may_administer("delete bindings")
    return transfer_id


def _send(reply: service.Reply) -> Response:
    headers = {"x-pdgate-wait": "timeout"} if reply.wait_timed_out else None
    return json_bytes(reply.body, reply.status, headers)


@router.put(
    "/{transfer_id}",
    status_code=201,
    responses={
        200: {"model": Binding, "description": "same content already stored"},
        201: {"model": Binding},
        409: {},
        422: {},
    },
    openapi_extra=json_body(BindingSpec),
    summary="Record where a transfer's KV must go (idempotent)",
)
async def put_binding(request: Request, c: Ctx, who: Writer, transfer_id: TransferId) -> Response:
    return _send(await service.put_binding(c, who, transfer_id, await request.body()))


@router.get(
    "/{transfer_id}",
    responses={200: {"model": Binding}, 404: {}},
    summary="Read a binding; with ?wait=S, long-poll until it exists (or reaches ?state=)",
)
async def get_binding(
    c: Ctx,
    _who: Reader,
    transfer_id: TransferId,
    wait: Annotated[float | None, Query(gt=0, le=3600, description="seconds to wait")] = None,
    state: Annotated[
        BindingState | None,
        Query(description="with wait: return once this state (or a later one) is reached"),
    ] = None,
) -> Response:
    return _send(await service.get_binding(c, transfer_id, wait, state))


@router.delete("/{transfer_id}", status_code=204, responses={404: {}}, openapi_extra=WRITE)
async def delete_binding(c: Ctx, transfer_id: Annotated[str, Depends(_deletable)]) -> Response:
    if not await c.store.delete_binding(transfer_id):
        raise NotFound(f"binding {transfer_id} not found")
    return Response(status_code=204)


@router.get("", summary="List bindings, newest first")
async def list_bindings(
    c: Ctx,
    _who: Reader,
    state: BindingState | None = None,
    instance: Annotated[str | None, Query(max_length=128, description="decode instance")] = None,
    limit: Annotated[int, Query(ge=1, le=1000)] = 100,
) -> Response:
    records = await c.store.list_bindings(state=state, instance_id=instance, limit=limit)
    return json_list("bindings", (r.to_json() for r in records))


@router.post(
    "/{transfer_id}/events",
    responses={
        200: {"model": Binding},
        403: {"description": "not the actor's step (docs/protocol.md: whose step is which)"},
        404: {},
        409: {"description": "an illegal change, or the lease another prefill holds"},
    },
    openapi_extra=json_body(EventIn),
    summary="Append a state change (bound → prefill_started → pushing → done|failed|aborted)",
)
async def post_event(request: Request, c: Ctx, who: Writer, transfer_id: TransferId) -> Response:
    return _send(await service.post_event(c, who, transfer_id, await request.body()))


@router.post(
    "/{transfer_id}/marks",
    status_code=204,
    responses={204: {"description": "recorded (or one of that kind already was)"}, 404: {}},
    openapi_extra=json_body(MarkIn),
    summary="Record a moment that is not a state (first_token, end); once per kind",
)
async def post_mark(request: Request, c: Ctx, who: Writer, transfer_id: TransferId) -> Response:
    await service.post_mark(c, who, transfer_id, await request.body())
    return Response(status_code=204)


@batch_router.post(
    BATCH_PATH,
    responses={200: {"model": BatchOut}, 422: {}},
    openapi_extra=json_body(BatchIn),
    summary="Several binding writes in one request, each answered as if sent alone",
)
async def post_batch(request: Request, c: Ctx, who: Writer) -> Response:
    reply = await batch.run(c, who, await request.body())
    return json_bytes(reply.body, reply.status)


_PREFIX = re.compile(PREFIX_PATTERN)


@feed_router.get(
    FEED_PATH,
    response_class=StreamingResponse,
    responses={200: {"content": {MEDIA_TYPE: {}}}, 422: {}},
    summary="Stream the bindings created from now on whose transfer id starts with a ?prefix=",
    description='NDJSON: `{"feed":"live"}` first; then each new binding as `GET '
    '/v1/bindings/{id}` answers it, and `{"feed":"keepalive"}` after ?keepalive= idle seconds; '
    '`{"feed":"lost"}` last when some may have been missed (read those with long-polls).',
)
async def binding_feed(
    c: Ctx,
    _who: Reader,
    prefix: Annotated[
        list[str],
        Query(description=f"transfer id prefix ({PREFIX_PATTERN}); 1 to {MAX_PREFIXES} of them"),
    ],
    keepalive: Annotated[
        float, Query(ge=0.1, le=60, description="idle seconds between keepalive lines")
    ] = DEFAULT_KEEPALIVE_S,
) -> StreamingResponse:
    prefixes = tuple(dict.fromkeys(prefix))  # in order, once each
    if not 1 <= len(prefixes) <= MAX_PREFIXES:
        raise Unprocessable(f"prefix: give 1 to {MAX_PREFIXES}, not {len(prefixes)}")
    for p in prefixes:
        if not _PREFIX.fullmatch(p):  # "$" alone would let a trailing newline through
            raise Unprocessable(f"prefix {p[:80]!r} does not match {PREFIX_PATTERN}")
    assert c.feeds is not None
    return StreamingResponse(c.feeds.stream(prefixes, keepalive), media_type=MEDIA_TYPE)
