"""``POST /v1/ascend/metaserver``: where unchanged vllm-ascend decode engines post their blocks
(served by ``metaserver.fastpath``; this route documents it and serves the unusual cases)."""

from __future__ import annotations

from fastapi import APIRouter, Request, Response

from metaserver import ascend
from metaserver.context import ctx
from metaserver.responses import json_bytes
from metaserver.routes._openapi import json_body
from pdwire.ascend import COMPAT_PATH, AscendBinding

router = APIRouter(tags=["vllm-ascend"])


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
async def post_ascend_binding(request: Request) -> Response:
    c = ctx(request)
    grant = await ascend.authorize(c, request.headers.get("authorization", "").encode() or None,
                                   request.scope.get("query_string", b""))  # fmt: skip
    reply = await ascend.post_binding(c, grant, await request.body())
    return json_bytes(reply.body, reply.status)
