"""``PUT /v1/load/{replica}``: a proxy replica's load in, the other replicas' load out;
``GET`` the same: the others' load only (before a choice: a read, which Redis answers without
waiting for its disk). Only a proxy (or an admin) reports: its role is checked after the
replica name's own validation (a malformed name is 422 whoever asks)."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Depends, Path, Request

from metaserver.access.callers import Reader, Writer
from metaserver.context import Ctx
from metaserver.openapi import json_body
from metaserver.validation import parse_body
from pdwire.ids import INSTANCE_ID_PATTERN
from pdwire.models import LOAD_PATH, LoadReport, LoadView

router = APIRouter(tags=["proxy replicas"])
Replica = Annotated[str, Path(pattern=INSTANCE_ID_PATTERN, max_length=128)]


async def _reporting(who: Writer, replica: Replica) -> str:
    """The replica whose load the caller reports: a proxy's (or an admin's) call."""
    who.may_share_load()
    return replica


@router.put(
    LOAD_PATH,
    response_model=LoadView,
    responses={401: {}, 403: {}, 422: {}},
    openapi_extra=json_body(LoadReport),
    summary="Report one proxy replica's in-flight load; answer the other replicas' (summed)",
)
async def report(
    request: Request, c: Ctx, replica: Annotated[str, Depends(_reporting)]
) -> LoadView:
    body = parse_body(LoadReport, await request.body())
    return await c.load_board.report(replica, body)


@router.get(
    LOAD_PATH,
    response_model=LoadView,
    responses={401: {}, 422: {}},
    summary="The load of every proxy replica but this one (summed), reporting nothing",
)
async def view(c: Ctx, _who: Reader, replica: Replica) -> LoadView:
    return await c.load_board.view(replica)
