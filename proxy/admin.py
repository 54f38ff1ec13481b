"""``/admin``: operator calls on the proxy. Today: draining an instance.

``POST /admin/instances/{id}/drain`` takes an instance out of selection (no new requests; its
in-flight requests finish), ``DELETE`` puts it back. For an instance registered in the
metaserver the flag is set on its registration, so every proxy replica honours it within one
``--discovery-interval``; otherwise (a static URL the registry does not know, id
``host:port``) only this proxy does. ``GET /v1/instances`` lists ids, URLs and drains.

Off (403) unless ``--admin-key`` keys are set; those must differ from the ``--api-key`` keys
(a client key never drains the fleet).
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI, Request

from proxy.errors import Forbidden, Unauthorized
from proxy.handler import _authorized
from proxy.runtime import Runtime


def admin_routes(api: FastAPI, rt: Runtime) -> None:
    def check_admin(request: Request) -> None:
        if not rt.admin_keys:
            raise Forbidden("admin calls are off: start the proxy with --admin-key")
        auth = request.headers.get("authorization")
        if not _authorized(auth.encode() if auth else None, rt.admin_keys):
            raise Unauthorized("missing or invalid admin key")

    @api.get(
        "/v1/instances",
        summary="What the proxy sees: instances, their URLs, health, load, circuits (admin key)",
        responses={401: {}, 403: {}},
    )
    async def instances(request: Request) -> dict[str, Any]:
        check_admin(request)  # internal addresses and drains: an operator's view
        return {
            "flow": rt.settings.flow.value,
            "inflight": rt.admission.inflight,
            "instances": [i.describe() for i in rt.registry.instances()],
        }

    @api.post(
        "/admin/instances/{instance_id}/drain",
        summary="Drain an instance: no new requests, in-flight ones finish",
        responses={400: {}, 401: {}, 403: {}, 404: {}, 503: {}},
    )
    async def drain(request: Request, instance_id: str) -> dict[str, Any]:
        check_admin(request)
        return (await rt.drains.set(instance_id, True)).describe()

    @api.delete(
        "/admin/instances/{instance_id}/drain",
        summary="Undrain an instance: it is selected again",
        responses={400: {}, 401: {}, 403: {}, 404: {}, 503: {}},
    )
    async def undrain(request: Request, instance_id: str) -> dict[str, Any]:
        check_admin(request)
        return (await rt.drains.set(instance_id, False)).describe()
