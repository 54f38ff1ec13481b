"""``create_app``: the metaserver as a FastAPI app around an injected ``Store``."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi import FastAPI, Request, Response
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse

from metaserver.advisor import refresh
from metaserver.ascend import DecodeEndpoints
from metaserver.config import MetaserverSettings
from metaserver.context import Context
from metaserver.errors import MetaserverError
from metaserver.fastpath import FastPath
from metaserver.feeds import FeedHub
from metaserver.metrics import Metrics, MetricsMiddleware
from metaserver.problems import render_problem
from metaserver.responses import JSON
from metaserver.routes import (
    ascend,
    batch,
    bindings,
    breakdown,
    feeds,
    instances,
    kv,
    load,
    ops,
    ui,
)
from metaserver.store import Store, create_store
from metaserver.validation import BodyInvalid
from pdservice.asgi import ASGIApp
from pdservice.limits import BodySizeLimit
from pdwire.ascend import AscendBinding
from pdwire.models import (
    BatchIn,
    BindingSpec,
    EventIn,
    InstanceSpec,
    KVMatchIn,
    KVPlacedIn,
    LoadReport,
    MarkIn,
)

log = logging.getLogger("pdgate.metaserver")
_BODY_MODELS = (
    BindingSpec,
    EventIn,
    InstanceSpec,
    AscendBinding,
    MarkIn,
    BatchIn,
    KVMatchIn,
    KVPlacedIn,
    LoadReport,
)


def create_app(
    settings: MetaserverSettings | None = None,
    *,
    store: Store | None = None,
    clock: Callable[[], float] = time.time,
) -> FastAPI:
    settings = settings or MetaserverSettings()
    store = store or create_store(
        settings.store,
        namespace=settings.namespace,
        binding_ttl_s=settings.binding_ttl_s,
        retain_s=settings.retain_s,
        kv_placed_s=settings.kv_placed_s,
    )
    metrics = Metrics()

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await store.start()
        log.info("metaserver store: %s", store.description)
        loop = asyncio.get_running_loop()
        tasks = []
        if settings.ttft_target_p90_s is not None or settings.itl_target_p90_s is not None:
            tasks.append(loop.create_task(refresh(context)))
        if settings.kv_events:
            from metaserver.kvindex.manager import KVEventManager  # needs pyzmq

            context.kv_events = KVEventManager(
                store, store.kv_index(), interval_s=settings.kv_events_interval_s
            )
            tasks.append(loop.create_task(context.kv_events.run()))
        try:
            yield
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            assert context.access is not None
            await context.access.close()
            await store.close()

    app = _MetaserverApp(
        title="pdgate metaserver",
        version="0.1.0",
        description="Bindings (transfer → decode KV endpoint) and the instance registry.",
        lifespan=lifespan,
    )
    pool = DecodeEndpoints(
        settings.ascend_decode,
        store,
        use_registry=settings.ascend_registry,
        refresh_s=settings.ascend_refresh_s,
    )
    hub = FeedHub(store, metrics)
    context = Context(settings, store, metrics, clock, ascend=pool, feeds=hub)
    app.state.ctx = context
    for module in (bindings, batch, breakdown, feeds, instances, kv, load, ops, ascend):
        app.include_router(module.router)
    app.include_router(ui.make_router())
    _install_error_handlers(app, metrics)
    app.add_middleware(MetricsMiddleware, metrics=metrics)
    app.add_middleware(BodySizeLimit, max_bytes=settings.max_body_bytes)
    app.openapi = lambda: _openapi(app)  # type: ignore[method-assign]
    return app


class _MetaserverApp(FastAPI):
    """FastAPI with ``FastPath`` as the outermost layer (in front of the middleware stack)."""

    def build_middleware_stack(self) -> ASGIApp:
        return FastPath(super().build_middleware_stack(), self.state.ctx)


def _install_error_handlers(app: FastAPI, metrics: Metrics) -> None:
    async def on_problem(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, MetaserverError | BodyInvalid)
        status, body, headers = render_problem(exc, metrics)
        return Response(body, status, {k.decode(): v.decode() for k, v in headers}, JSON)

    async def on_params(request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, RequestValidationError)
        errors = [{"loc": list(e["loc"]), "msg": e["msg"], "type": e["type"]} for e in exc.errors()]
        return JSONResponse({"detail": errors}, 422)

    app.add_exception_handler(MetaserverError, on_problem)
    app.add_exception_handler(BodyInvalid, on_problem)
    app.add_exception_handler(RequestValidationError, on_params)


def _openapi(app: FastAPI) -> dict[str, Any]:
    if app.openapi_schema:
        return app.openapi_schema
    schema = get_openapi(
        title=app.title, version=app.version, description=app.description, routes=app.routes
    )
    components = schema.setdefault("components", {})
    schemas = components.setdefault("schemas", {})
    for model in _BODY_MODELS:
        body = model.model_json_schema(ref_template="#/components/schemas/{model}")
        schemas.update(body.pop("$defs", {}))
        schemas[model.__name__] = body
    components["securitySchemes"] = {"bearer": {"type": "http", "scheme": "bearer"}}
    app.openapi_schema = schema
    return schema
