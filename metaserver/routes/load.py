"""``PUT /v1/load/{replica}``: a proxy replica's load in, the other replicas' load out;
``GET`` the same: the others' load only (before a choice: a read, which Redis answers without
waiting for its disk)."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Path, Request

from metaserver.context import Reader, Writer, ctx
from metaserver.routes._openapi import json_body
from metaserver.validation import parse_body
from pdwire.ids import INSTANCE_ID_PATTERN
from pdwire.models import LOAD_PATH, LoadReport, LoadView

router = APIRouter(tags=["proxy replicas"])
Replica = Annotated[str, Path(pattern=INSTANCE_ID_PATTERN, max_length=128)]


@router.put(
    LOAD_PATH,
    response_model=LoadView,
    responses={401: {}, 403: {}, 422: {}},
    openapi_extra=json_body(LoadReport),
    summary="Report one proxy replica's in-flight load; answer the other replicas' (summed)",
)
async def report(request: Request, who: Writer, replica: Replica) -> LoadView:
    c = ctx(request)
    who.may_share_load()
    body = parse_body(LoadReport, await request.body())
    return await c.store.load_board().report(replica, body)


@router.get(
    LOAD_PATH,
    response_model=LoadView,
    responses={401: {}, 422: {}},
    summary="The load of every proxy replica but this one (summed), reporting nothing",
)
async def view(request: Request, _who: Reader, replica: Replica) -> LoadView:
    c = ctx(request)
    return await c.store.load_board().view(replica)
