"""``/v1/instances``: vLLM servers that registered (and heartbeat) so bindings may name them. The
registry's records are the store's (``store.records``); what a caller may register, drain or
deregister is checked here against the instance (``Principal.may_*``)."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Path, Request, Response

from metaserver.access.callers import Reader, Writer
from metaserver.context import Ctx
from metaserver.errors import NotFound, Unprocessable
from metaserver.openapi import WRITE, json_body
from metaserver.responses import json_bytes, json_list
from metaserver.store.records import InstancePut, PutOutcome
from metaserver.validation import parse_body
from pdwire.ids import INSTANCE_ID_PATTERN
from pdwire.models import LATER_FIELDS, Instance, InstanceRole, InstanceSpec

router = APIRouter(prefix="/v1/instances", tags=["instances"])
InstanceId = Annotated[str, Path(pattern=INSTANCE_ID_PATTERN)]


@router.put(
    "/{instance_id}",
    status_code=201,
    responses={
        200: {"model": Instance, "description": "heartbeat of a known instance"},
        201: {"model": Instance},
        403: {"description": "the credential may not register this (its id, role, hosts, cap)"},
        409: {"description": "another live instance has this url or kv_endpoint"},
    },
    openapi_extra=json_body(InstanceSpec),
    summary="Register an instance, or heartbeat it (same call); expires after its TTL",
)
async def put_instance(request: Request, c: Ctx, who: Writer, instance_id: InstanceId) -> Response:
    spec = parse_body(InstanceSpec, await request.body())
    who.may_register(instance_id, spec)
    ttl = spec.ttl_s if spec.ttl_s is not None else c.settings.instance_ttl_s
    if ttl > c.settings.max_instance_ttl_s:
        raise Unprocessable(
            f"ttl_s {ttl:g} is above this metaserver's cap ({c.settings.max_instance_ttl_s:g} s)"
        )
    # fields newer readers know, left out when unset: a reader from before them (a proxy or
    # connector not upgraded yet) parses every record it parsed before
    unset = {name for name in LATER_FIELDS if getattr(spec, name) is None}
    body = spec.model_dump_json(exclude=unset).encode()
    put = InstancePut.of(instance_id, spec, ttl, who.owner, who.max_instances, body)
    outcome, record = await c.store.put_instance(put, c.clock())
    return json_bytes(record.to_json(), 201 if outcome is PutOutcome.CREATED else 200)


@router.get("/{instance_id}", responses={200: {"model": Instance}, 404: {}})
async def get_instance(c: Ctx, _who: Reader, instance_id: InstanceId) -> Response:
    record = await c.store.get_instance(instance_id)
    if record is None:
        raise NotFound(f"instance {instance_id} not registered")
    return json_bytes(record.to_json())


@router.get("", summary="Live instances (TTL not lapsed)")
async def list_instances(c: Ctx, _who: Reader, role: InstanceRole | None = None) -> Response:
    records = await c.store.list_instances(None if role is None else role.value)
    return json_list("instances", (r.to_json() for r in records))


@router.delete(
    "/{instance_id}",
    status_code=204,
    responses={404: {}},
    openapi_extra=WRITE,
)
async def delete_instance(c: Ctx, who: Writer, instance_id: InstanceId) -> Response:
    who.may_manage(instance_id)
    if not await c.store.delete_instance(instance_id):
        raise NotFound(f"instance {instance_id} not registered")
    return Response(status_code=204)


async def _set_draining(c: Ctx, who: Writer, instance_id: str, draining: bool) -> Response:
    who.may_drain(instance_id)
    record = await c.store.set_draining(instance_id, draining)
    if record is None:
        raise NotFound(f"instance {instance_id} not registered")
    return json_bytes(record.to_json())


@router.put(
    "/{instance_id}/drain",
    responses={200: {"model": Instance}, 404: {}},
    openapi_extra=WRITE,
    summary="Drain a registered instance: proxies send it no new requests (kept across "
    "heartbeats, forgotten with the registration)",
)
async def drain_instance(c: Ctx, who: Writer, instance_id: InstanceId) -> Response:
    return await _set_draining(c, who, instance_id, True)


@router.delete(
    "/{instance_id}/drain",
    responses={200: {"model": Instance}, 404: {}},
    openapi_extra=WRITE,
    summary="Undrain an instance: proxies select it again",
)
async def undrain_instance(c: Ctx, who: Writer, instance_id: InstanceId) -> Response:
    return await _set_draining(c, who, instance_id, False)
