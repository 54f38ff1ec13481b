"""What both clients share: how each call maps to HTTP and how answers are decoded."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, TypeVar
from urllib.parse import urlencode

import msgspec
from pydantic import BaseModel

from pdwire.models import (
    BATCH_PATH,
    KV_MATCH_PATH,
    KV_PLACED_PATH,
    LOAD_PATH,
    Binding,
    BindingSpec,
    BindingState,
    EventDetail,
    EventIn,
    Instance,
    InstanceSpec,
    LoadReport,
    MarkDetail,
    MarkIn,
    MarkKind,
    Stats,
)

M = TypeVar("M", bound=BaseModel)


def auth_headers(token: str | None) -> dict[str, str]:
    """The header that authorizes a call (``--token`` on the metaserver), or none."""
    return {"authorization": f"Bearer {token}"} if token else {}


def headers(token: str | None) -> dict[str, str]:
    """What every client call sends: a JSON body type and, with a token, the authorization."""
    return {"content-type": "application/json", **auth_headers(token)}


@dataclass(frozen=True, slots=True)
class Call:
    method: str
    path: str
    params: dict[str, str] | None = None
    body: bytes | None = None
    extra_timeout: float = 0.0  # long-polls stay open this much longer than the call timeout


def binding_path(transfer_id: str) -> str:
    return f"/v1/bindings/{transfer_id}"


def put_binding(transfer_id: str, spec: BindingSpec) -> Call:
    return Call("PUT", binding_path(transfer_id), body=spec.model_dump_json().encode())


def get_binding(transfer_id: str, wait: float | None, state: BindingState | None) -> Call:
    params: dict[str, str] = {}
    if wait is not None:
        params["wait"] = repr(float(wait))
    if state is not None:
        params["state"] = state.value
    return Call("GET", binding_path(transfer_id), params or None, None, wait or 0.0)


def binding_url(base_url: str, transfer_id: str, wait: float | None = None) -> str:
    """The whole URL of ``get_binding`` (for HTTP clients that take one string)."""
    call = get_binding(transfer_id, wait, None)
    query = f"?{urlencode(call.params)}" if call.params else ""
    return f"{base_url.rstrip('/')}{call.path}{query}"


def delete_binding(transfer_id: str) -> Call:
    return Call("DELETE", binding_path(transfer_id))


def list_bindings(state: BindingState | None, instance: str | None, limit: int) -> Call:
    params = {"limit": str(limit)}
    if state is not None:
        params["state"] = state.value
    if instance is not None:
        params["instance"] = instance
    return Call("GET", "/v1/bindings", params)


def post_event(
    transfer_id: str, state: BindingState, actor: str, detail: EventDetail | None
) -> Call:
    body = EventIn(state=state, actor=actor, detail=detail).model_dump_json(exclude_none=True)
    return Call("POST", f"{binding_path(transfer_id)}/events", body=body.encode())


def post_mark(transfer_id: str, mark: MarkKind, actor: str, detail: MarkDetail | None) -> Call:
    body = MarkIn(mark=mark, actor=actor, detail=detail).model_dump_json(exclude_none=True)
    return Call("POST", f"{binding_path(transfer_id)}/marks", body=body.encode())


def put_instance(instance_id: str, spec: InstanceSpec) -> Call:
    return Call("PUT", f"/v1/instances/{instance_id}", body=spec.model_dump_json().encode())


def get_instance(instance_id: str) -> Call:
    return Call("GET", f"/v1/instances/{instance_id}")


def list_instances(role: str | None) -> Call:
    return Call("GET", "/v1/instances", None if role is None else {"role": role})


def delete_instance(instance_id: str) -> Call:
    return Call("DELETE", f"/v1/instances/{instance_id}")


def drain_instance(instance_id: str, draining: bool) -> Call:
    """Drain (``PUT``) or undrain (``DELETE``) a registered instance; answers the record."""
    return Call("PUT" if draining else "DELETE", f"/v1/instances/{instance_id}/drain")


def batch(calls: Sequence[Call]) -> Call:
    """Several binding writes (``put_binding``, ``post_event``, ``post_mark`` calls) as one
    ``POST /v1/batch``; each call's body goes in as it is, not serialised again."""
    items = b",".join(
        b'{"method":"%s","path":%s,"body":%s}'
        % (c.method.encode(), json.dumps(c.path).encode(), c.body or b"{}")
        for c in calls
    )
    return Call("POST", BATCH_PATH, body=b'{"calls":[' + items + b"]}")


@dataclass(frozen=True, slots=True)
class BatchItem:
    """One call's answer in a batch: the status and body its own request would have had."""

    status: int
    body: bytes


def batch_results(content: bytes, calls: int) -> list[BatchItem]:
    """The answers of a ``batch`` of ``calls`` calls, in their order; ``ValueError`` when the
    answer is not one result per call."""
    results = json.loads(content)["results"]
    if not isinstance(results, list) or len(results) != calls:
        raise ValueError(f"a batch of {calls} calls was answered with {len(results)} results")
    return [
        BatchItem(int(r["status"]), b"" if r["body"] is None else json.dumps(r["body"]).encode())
        for r in results
    ]


def kv_match(keys: Sequence[int], instances: Sequence[str]) -> Call:
    """Per request on the proxy's path: encoded with msgspec, checked by the metaserver
    (``KVMatchIn``)."""
    body = msgspec.json.encode({"keys": keys, "instances": instances})
    return Call("POST", KV_MATCH_PATH, body=body)


def kv_placed(placed: Sequence[tuple[str, Sequence[int]]]) -> Call:
    """The proxy's choices, batched: ``(instance id, the prompt's block keys)`` each; encoded
    with msgspec, checked by the metaserver (``KVPlacedIn``)."""
    body = msgspec.json.encode({"placed": [{"instance": i, "keys": k} for i, k in placed]})
    return Call("POST", KV_PLACED_PATH, body=body)


def share_load(replica: str, report: LoadReport) -> Call:
    return Call("PUT", LOAD_PATH.format(replica=replica), body=report.model_dump_json().encode())


def view_load(replica: str) -> Call:
    return Call("GET", LOAD_PATH.format(replica=replica))


STATS = Call("GET", "/v1/stats")
READY = Call("GET", "/ready")


def decode(model: type[M], body: bytes) -> M:
    return model.model_validate_json(body)


def decode_list(model: type[M], key: str, body: bytes) -> list[M]:
    items: list[Any] = json.loads(body)[key]
    return [model.model_validate(item) for item in items]


__all__ = ["Binding", "Call", "Instance", "Stats", "decode", "decode_list"]
