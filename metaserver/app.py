"""``create_app``: the metaserver as a FastAPI app around a backend (``metaserver.backend``: the
store, the KV index and the load board), assembled from the subsystems' routers, the fast path
in front, the middleware and the error handlers."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Callable

from fastapi import FastAPI, Request, Response
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse

from metaserver import openapi
from metaserver.ascend import routes as ascend
from metaserver.ascend.pool import DecodeEndpoints
from metaserver.backend import Backend, create_backend
from metaserver.bindings import routes as bindings
from metaserver.bindings.fastpath import FastPath
from metaserver.bindings.feeds import FeedHub
from metaserver.capacity import routes as capacity
from metaserver.capacity.advisor import refresh
from metaserver.config import MetaserverSettings
from metaserver.context import Context
from metaserver.errors import MetaserverError
from metaserver.instances import routes as instances
from metaserver.kvindex import routes as kv
from metaserver.load import routes as load
from metaserver.metrics import Metrics, MetricsMiddleware
from metaserver.ops import page
from metaserver.ops import routes as ops
from metaserver.problems import render_problem
from metaserver.responses import JSON
from metaserver.validation import BodyInvalid
from pdservice.asgi import ASGIApp
from pdservice.limits import BodySizeLimit

log = logging.getLogger("pdgate.metaserver")


def create_app(
    settings: MetaserverSettings | None = None,
    *,
    backend: Backend | None = None,
    clock: Callable[[], float] = time.time,
) -> FastAPI:
    """``backend``: the one the settings name (``--store``) unless given."""
    settings = settings or MetaserverSettings()
    backend = backend or create_backend(
        settings.store,
        namespace=settings.namespace,
        binding_ttl_s=settings.binding_ttl_s,
        retain_s=settings.retain_s,
        kv_placed_s=settings.kv_placed_s,
    )
    metrics = Metrics()

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await backend.start()
        log.info("metaserver store: %s", backend.description)
        loop = asyncio.get_running_loop()
        tasks = []
        if settings.ttft_target_p90_s is not None or settings.itl_target_p90_s is not None:
            tasks.append(loop.create_task(refresh(context)))
        if settings.kv_events:
            from metaserver.kvindex.manager import KVEventManager  # needs pyzmq

            context.kv_events = KVEventManager(
                backend.store, backend.kv_index, interval_s=settings.kv_events_interval_s
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
            await backend.close()

    app = _MetaserverApp(
        title="pdgate metaserver",
        version="0.1.0",
        description="Bindings (transfer → decode KV endpoint) and the instance registry.",
        lifespan=lifespan,
    )
    pool = DecodeEndpoints(
        settings.ascend_decode,
        backend.store,
        use_registry=settings.ascend_registry,
        refresh_s=settings.ascend_refresh_s,
    )
    hub = FeedHub(backend.store, metrics)
    context = Context(settings, backend, metrics, clock, ascend=pool, feeds=hub)
    app.state.ctx = context
    for router in (
        bindings.router,
        bindings.batch_router,
        capacity.router,
        bindings.feed_router,
        instances.router,
        kv.router,
        load.router,
        ops.router,
        ascend.router,
    ):
        app.include_router(router)
    app.include_router(page.make_router())
    _install_error_handlers(app, metrics)
    app.add_middleware(MetricsMiddleware, metrics=metrics)
    app.add_middleware(BodySizeLimit, max_bytes=settings.max_body_bytes)
    app.openapi = lambda: openapi.schema(app)  # type: ignore[method-assign]
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
