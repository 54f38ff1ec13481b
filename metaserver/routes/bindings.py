"""``/v1/bindings``: where prefill must push a transfer's KV, and its state history."""

from __future__ import annotations

import asyncio
from typing import Annotated

from fastapi import APIRouter, Path, Query, Request, Response

from metaserver.context import ctx
from metaserver.errors import NotFound
from metaserver.models import (
    TRANSFER_ID_PATTERN,
    Binding,
    BindingSpec,
    BindingState,
    EventIn,
)
from metaserver.responses import json_bytes, json_list
from metaserver.store.base import BindingPut, PutOutcome, StoredBinding, event_json
from metaserver.validation import parse_body

router = APIRouter(prefix="/v1/bindings", tags=["bindings"])
TransferId = Annotated[str, Path(pattern=TRANSFER_ID_PATTERN)]
_WRITE: dict[str, object] = {"security": [{"bearer": []}]}


def _body(model: type[BindingSpec] | type[EventIn]) -> dict[str, object]:
    ref = {"$ref": f"#/components/schemas/{model.__name__}"}
    return {
        "requestBody": {"required": True, "content": {"application/json": {"schema": ref}}},
        **_WRITE,
    }


@router.put(
    "/{transfer_id}",
    status_code=201,
    responses={
        200: {"model": Binding, "description": "same content already stored"},
        201: {"model": Binding},
        409: {},
        422: {},
    },
    openapi_extra=_body(BindingSpec),
    summary="Record where a transfer's KV must go (idempotent)",
)
async def put_binding(request: Request, transfer_id: TransferId) -> Response:
    c = ctx(request)
    c.authorize(request, write=True)
    spec = parse_body(BindingSpec, await request.body())
    now = c.clock()
    outcome, record = await c.store.put_binding(BindingPut.of(transfer_id, spec, now), now)
    if outcome is PutOutcome.CREATED:
        c.metrics.bindings_created.inc()
        return json_bytes(record.to_json(), 201)
    return json_bytes(record.to_json(), 200)


def _reached(record: StoredBinding | None, state: BindingState | None) -> bool:
    return record is not None and (state is None or record.state.rank >= state.rank)


@router.get(
    "/{transfer_id}",
    responses={200: {"model": Binding}, 404: {}},
    summary="Read a binding; with ?wait=S, long-poll until it exists (or reaches ?state=)",
)
async def get_binding(
    request: Request,
    transfer_id: TransferId,
    wait: Annotated[float | None, Query(gt=0, le=3600, description="seconds to wait")] = None,
    state: Annotated[
        BindingState | None,
        Query(description="with wait: return once this state (or a later one) is reached"),
    ] = None,
) -> Response:
    c = ctx(request)
    c.authorize(request, write=False)
    record = await c.store.get_binding(transfer_id)
    timed_out = False
    if wait is not None and not _reached(record, state):
        loop = asyncio.get_running_loop()
        deadline = loop.time() + min(wait, c.settings.max_wait_s)
        c.metrics.waiters.inc()
        try:
            async with c.store.changes(transfer_id) as sub:
                record = await c.store.get_binding(transfer_id)  # closes the subscribe race
                while not _reached(record, state):
                    remaining = deadline - loop.time()
                    if remaining <= 0:
                        timed_out = True
                        break
                    if await sub.wait(remaining):
                        record = await c.store.get_binding(transfer_id)
        finally:
            c.metrics.waiters.dec()
    if record is None:
        raise NotFound(f"binding {transfer_id} not found" + (" (wait timed out)" if wait else ""))
    headers = {"x-pdgate-wait": "timeout"} if timed_out else None
    return json_bytes(record.to_json(), 200, headers)


@router.delete("/{transfer_id}", status_code=204, responses={404: {}}, openapi_extra=_WRITE)
async def delete_binding(request: Request, transfer_id: TransferId) -> Response:
    c = ctx(request)
    c.authorize(request, write=True)
    if not await c.store.delete_binding(transfer_id):
        raise NotFound(f"binding {transfer_id} not found")
    return Response(status_code=204)


@router.get("", summary="List bindings, newest first")
async def list_bindings(
    request: Request,
    state: BindingState | None = None,
    instance: Annotated[str | None, Query(max_length=128, description="decode instance")] = None,
    limit: Annotated[int, Query(ge=1, le=1000)] = 100,
) -> Response:
    c = ctx(request)
    c.authorize(request, write=False)
    records = await c.store.list_bindings(state=state, instance_id=instance, limit=limit)
    return json_list("bindings", (r.to_json() for r in records))


@router.post(
    "/{transfer_id}/events",
    responses={200: {"model": Binding}, 404: {}, 409: {}},
    openapi_extra=_body(EventIn),
    summary="Append a state change (bound → prefill_started → pushing → done|failed|aborted)",
)
async def post_event(request: Request, transfer_id: TransferId) -> Response:
    c = ctx(request)
    c.authorize(request, write=True)
    event = parse_body(EventIn, await request.body())
    now = c.clock()
    detail = None if event.detail is None else event.detail.model_dump_json(exclude_none=True)
    body = event_json(event.state, event.actor, now, None if detail is None else detail.encode())
    record = await c.store.add_event(transfer_id, event.state, body, now)
    c.metrics.events.labels(event.state.value).inc()
    return json_bytes(record.to_json())
