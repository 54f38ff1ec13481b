"""``/v1/bindings``: where prefill must push a transfer's KV, and its state history."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Path, Query, Request, Response

from metaserver import service
from metaserver.context import Reader, Writer, ctx
from metaserver.errors import NotFound
from metaserver.responses import json_bytes, json_list
from metaserver.routes._openapi import WRITE, json_body
from pdwire.ids import TRANSFER_ID_PATTERN
from pdwire.models import (
    Binding,
    BindingSpec,
    BindingState,
    EventIn,
    MarkIn,
)

router = APIRouter(prefix="/v1/bindings", tags=["bindings"])
TransferId = Annotated[str, Path(pattern=TRANSFER_ID_PATTERN)]


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
async def put_binding(request: Request, who: Writer, transfer_id: TransferId) -> Response:
    c = ctx(request)
    return _send(await service.put_binding(c, who, transfer_id, await request.body()))


def _send(reply: service.Reply) -> Response:
    headers = {"x-pdgate-wait": "timeout"} if reply.wait_timed_out else None
    return json_bytes(reply.body, reply.status, headers)


@router.get(
    "/{transfer_id}",
    responses={200: {"model": Binding}, 404: {}},
    summary="Read a binding; with ?wait=S, long-poll until it exists (or reaches ?state=)",
)
async def get_binding(
    request: Request,
    _who: Reader,
    transfer_id: TransferId,
    wait: Annotated[float | None, Query(gt=0, le=3600, description="seconds to wait")] = None,
    state: Annotated[
        BindingState | None,
        Query(description="with wait: return once this state (or a later one) is reached"),
    ] = None,
) -> Response:
    c = ctx(request)
    return _send(await service.get_binding(c, transfer_id, wait, state))


@router.delete("/{transfer_id}", status_code=204, responses={404: {}}, openapi_extra=WRITE)
async def delete_binding(request: Request, who: Writer, transfer_id: TransferId) -> Response:
    c = ctx(request)
    who.may_administer("delete bindings")
    if not await c.store.delete_binding(transfer_id):
        raise NotFound(f"binding {transfer_id} not found")
    return Response(status_code=204)


@router.get("", summary="List bindings, newest first")
async def list_bindings(
    request: Request,
    _who: Reader,
    state: BindingState | None = None,
    instance: Annotated[str | None, Query(max_length=128, description="decode instance")] = None,
    limit: Annotated[int, Query(ge=1, le=1000)] = 100,
) -> Response:
    c = ctx(request)
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
async def post_event(request: Request, who: Writer, transfer_id: TransferId) -> Response:
    c = ctx(request)
    return _send(await service.post_event(c, who, transfer_id, await request.body()))


@router.post(
    "/{transfer_id}/marks",
    status_code=204,
    responses={204: {"description": "recorded (or one of that kind already was)"}, 404: {}},
    openapi_extra=json_body(MarkIn),
    summary="Record a moment that is not a state (first_token, end); once per kind",
)
async def post_mark(request: Request, who: Writer, transfer_id: TransferId) -> Response:
    c = ctx(request)
    await service.post_mark(c, who, transfer_id, await request.body())
    return Response(status_code=204)
