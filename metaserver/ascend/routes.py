"""``POST /v1/ascend/metaserver``: where unchanged vllm-ascend decode engines post their blocks
(served by ``bindings.fastpath``; this route documents it and serves the unusual cases). Its
caller is a ``Grant`` (``compat.authorize``: a capability in the query, or an admin's header),
resolved as a dependency."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Depends, Request, Response

from metaserver.ascend import compat
from metaserver.context import Ctx, ctx
from metaserver.openapi import json_body
from metaserver.responses import json_bytes
from pdwire.ascend import COMPAT_PATH, AscendBinding

router = APIRouter(tags=["vllm-ascend"])


async def _granted(request: Request) -> compat.Grant:
    header = request.headers.get("authorization", "").encode() or None
    return await compat.authorize(ctx(request), header, request.scope.get("query_string", b""))


Granted = Annotated[compat.Grant, Depends(_granted)]


@router.post(
    COMPAT_PATH,
    responses={200: {}, 401: {}, 403: {}, 409: {}, 422: {}},
    openapi_extra={
        **json_body(AscendBinding, write=False),
        "parameters": [
            {
                "name": "rid",
                "in": "query",
                "required": False,
                "schema": {"type": "string"},
                "description": "the X-Request-Id the capability is for",
            },
            {
                "name": "cap",
                "in": "query",
                "required": False,
                "schema": {"type": "string"},
                "description": "that request's capability, when the metaserver needs "
                "credentials (D sends no header)",
            },
        ],
    },
    summary="Record a vllm-ascend decode engine's blocks (MooncakeLayerwiseConnector)",
)
async def post_ascend_binding(request: Request, c: Ctx, grant: Granted) -> Response:
    reply = await compat.post_binding(c, grant, await request.body())
    return json_bytes(reply.body, reply.status)
