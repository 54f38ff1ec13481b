"""``create_app``: the proxy as one ASGI app.

The two completion endpoints are served by the lean ``CompletionsHandler``; everything else
(``/health``, ``/metrics``, ``/v1/models``, ``/v1/instances``, ``/admin``, OpenAPI) by
FastAPI, which also runs the lifespan (session, discovery, drains, health probes). Both cap
request bodies (``--max-body-bytes``): the handler itself, FastAPI behind ``BodySizeLimit``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from pdservice.asgi import ASGIApp, Receive, Scope, Send
from pdservice.limits import BodySizeLimit
from proxy.admin import admin_routes
from proxy.config import ProxySettings
from proxy.errors import ProxyError, Unauthorized, error_object
from proxy.handler import HOT_PATHS, CompletionsHandler, _authorized
from proxy.instances import Role
from proxy.model_list import read_capped, rebuilt
from proxy.runtime import Runtime

log = logging.getLogger("pdgate.proxy")


class ProxyApp:
    """The proxy's ASGI app: completions straight to ``CompletionsHandler`` (which caps the
    body itself), everything else through FastAPI behind the body cap. ``runtime`` holds the
    shared state (registry, dispatcher, metrics)."""

    def __init__(self, runtime: Runtime, hot: CompletionsHandler, rest: ASGIApp) -> None:
        self.runtime = runtime
        # read by the listener's protocol (pdservice.listener)
        self.receipt_timeout_s = runtime.settings.receipt_timeout_s
        self.max_client_connections = runtime.settings.max_client_connections
        self.write_timeout_s = runtime.settings.write_timeout_s
        self._hot = hot
        self._rest = rest

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"] in HOT_PATHS and scope["method"] == "POST":
            await self._hot(scope, receive, send)
        else:
            await self._rest(scope, receive, send)


def create_app(settings: ProxySettings) -> ProxyApp:
    rt = Runtime(settings)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await rt.start()
        try:
            yield
        finally:
            await rt.close()

    api = FastAPI(
        title="pdgate proxy",
        version="0.1.0",
        description="OpenAI-compatible prefill/decode router.",
        lifespan=lifespan,
    )
    api.state.runtime = rt
    _routes(api, rt)
    admin_routes(api, rt)
    handler = CompletionsHandler(rt)

    def error_body(message: str) -> dict[str, Any]:
        return error_object(message, "invalid_request_error", 413)

    rest = BodySizeLimit(api, max_bytes=settings.max_body_bytes, error_body=error_body)
    return ProxyApp(rt, handler, rest)


def _routes(api: FastAPI, rt: Runtime) -> None:
    @api.exception_handler(ProxyError)
    async def on_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, ProxyError)
        return Response(exc.body(), exc.status, media_type="application/json")

    def check_key(request: Request) -> None:
        if rt.api_keys:
            auth = request.headers.get("authorization")
            if not _authorized(auth.encode() if auth else None, rt.api_keys):
                raise Unauthorized("missing or invalid API key")

    @api.get("/health", summary="200 when both pools have a selectable instance")
    async def health() -> Response:
        pools = {
            role.value: sum(1 for i in rt.registry.all(role) if i.available()) for role in Role
        }
        needs_p = rt.settings.flow.value != "direct"
        ok = pools["decode"] > 0 and (pools["prefill"] > 0 or not needs_p)
        body = {"status": "ok" if ok else "unavailable", "available": pools}
        return JSONResponse(body, 200 if ok else 503)

    @api.get("/metrics", summary="Prometheus metrics")
    async def metrics() -> Response:
        return Response(rt.metrics.render(), media_type="text/plain; version=0.0.4")

    @api.get("/v1/models", summary="Models served by the decode pool")
    async def models(request: Request) -> Response:
        check_key(request)
        assert rt.dispatcher is not None and rt.session is not None
        candidates = [i for i in rt.registry.all(Role.DECODE) if i.available()]
        key = rt.settings.engine_authorization
        auth = {} if key is None else {"authorization": key}
        for inst in candidates[:3]:
            with contextlib.suppress(Exception):
                async with asyncio.timeout(5):
                    async with rt.session.get(inst.url + "/v1/models", headers=auth) as resp:
                        if resp.status == 200:
                            models = rebuilt(await read_capped(resp.content))
                            if models is not None:
                                return Response(models, media_type="application/json")
                            log.warning("%s: /v1/models is not a model list", inst.id)
        body = error_object("no decode instance answered /v1/models", "service_unavailable", 503)
        return JSONResponse(body, 503)
