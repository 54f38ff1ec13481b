"""``create_app``: the metaserver as a FastAPI app around an injected ``Store``."""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse

from metaserver.config import MetaserverSettings
from metaserver.context import Context
from metaserver.errors import MetaserverError, StoreUnavailable
from metaserver.limits import BodySizeLimit
from metaserver.metrics import Metrics, MetricsMiddleware
from metaserver.models import BindingSpec, EventIn, InstanceSpec
from metaserver.routes import bindings, instances, ops
from metaserver.store import Store, create_store
from metaserver.validation import BodyInvalid

log = logging.getLogger("pdgate.metaserver")
_BODY_MODELS = (BindingSpec, EventIn, InstanceSpec)


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
    )
    metrics = Metrics()

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await store.start()
        log.info("metaserver store: %s", store.description)
        try:
            yield
        finally:
            await store.close()

    app = FastAPI(
        title="pdgate metaserver",
        version="0.1.0",
        description="Bindings (transfer → decode KV endpoint) and the instance registry.",
        lifespan=lifespan,
    )
    app.state.ctx = Context(settings=settings, store=store, metrics=metrics, clock=clock)
    for module in (bindings, instances, ops):
        app.include_router(module.router)
    _install_error_handlers(app, metrics)
    app.add_middleware(MetricsMiddleware, metrics=metrics)
    app.add_middleware(BodySizeLimit, max_bytes=settings.max_body_bytes)
    app.openapi = lambda: _openapi(app)  # type: ignore[method-assign]
    return app


def _install_error_handlers(app: FastAPI, metrics: Metrics) -> None:
    async def on_error(request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, MetaserverError)
        if isinstance(exc, StoreUnavailable):
            metrics.store_errors.inc()
            log.warning("%s %s: %s", request.method, request.url.path, exc.message)
        headers = {"retry-after": "1"} if isinstance(exc, StoreUnavailable) else None
        return JSONResponse({"detail": exc.message}, exc.status_code, headers=headers)

    async def on_body(request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, BodyInvalid)
        return JSONResponse({"detail": exc.errors}, 422)

    async def on_params(request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, RequestValidationError)
        errors = [{"loc": list(e["loc"]), "msg": e["msg"], "type": e["type"]} for e in exc.errors()]
        return JSONResponse({"detail": errors}, 422)

    app.add_exception_handler(MetaserverError, on_error)
    app.add_exception_handler(BodyInvalid, on_body)
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
