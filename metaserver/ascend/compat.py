"""The compat call itself: who may post a vllm-ascend D's blocks (``authorize``: a per-request
capability in the query, since D sends no header, or an admin's credential) and how they are
stored (``post_binding``: as the binding of D's request id, at once). The documented route and
the fast path both call these."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from urllib.parse import parse_qs

from metaserver.bindings.service import Reply
from metaserver.context import Context
from metaserver.errors import Forbidden, Unauthorized, Unprocessable
from metaserver.store.records import BindingPut, PutOutcome, event_json
from metaserver.validation import parse_body
from pdwire.ascend import AscendBinding, x_request_id_of
from pdwire.ids import valid_id
from pdwire.models import BindingState

log = logging.getLogger("pdgate.metaserver.ascend")


@dataclass(frozen=True, slots=True)
class Grant:
    """What the caller of the compat endpoint may bind: any request (a header credential, or
    no credentials needed), or only D requests made from one ``X-Request-Id``."""

    x_request_id: str | None = None


_warned: list[bool] = []


async def authorize(c: Context, header: bytes | None, query: bytes) -> Grant:
    """``?rid=&cap=`` (D's connector cannot send a header), else an admin's Authorization."""
    assert c.access is not None
    if c.access.open:
        return Grant()
    values = parse_qs(query.decode("latin-1"))
    rid, cap = values.get("rid"), values.get("cap")
    if rid and cap:
        if c.access.capability_ok(rid[0], cap[0]):
            return Grant(rid[0])
        raise Unauthorized("wrong capability in ?cap=")
    legacy = values.get("token")  # what proxies before capabilities sent (single-token mode)
    if legacy and c.access.mode == "single token":
        if not c.access.token_ok(legacy[0]):
            raise Unauthorized("wrong token in ?token=")
        if not _warned:
            _warned.append(True)
            log.warning(
                "a proxy sent the metaserver token in ?token=: upgrade it (it now sends "
                "a per-request capability); this form goes in the next release"
            )
        return Grant()
    who = await c.authorize(header, write=True)
    who.may_administer("post vllm-ascend blocks without a capability")
    return Grant()


async def post_binding(c: Context, grant: Grant, body: bytes) -> Reply:
    """Validate, vet, store; ``{"status": "ok", ...}`` at once (D ignores the answer)."""
    assert c.ascend is not None
    spec = parse_body(AscendBinding, body)
    if grant.x_request_id is not None and x_request_id_of(spec.request_id) != grant.x_request_id:
        raise Forbidden(
            f"the capability is for X-Request-Id {grant.x_request_id!r}, not for "
            f"request {spec.request_id!r}"
        )
    why = await c.ascend.problem(spec.remote_host, spec.remote_port)
    if why is not None:
        c.metrics.ascend_refused.inc()
        raise Unprocessable(why)
    now = c.clock()
    instance = spec.remote_engine_id if valid_id(spec.remote_engine_id) else "ascend-decode"
    put = BindingPut(
        transfer_id=spec.request_id,
        spec_json=spec.model_dump_json().encode(),
        decode_instance_id=instance,
        kv_host=spec.remote_host,
        kv_port=spec.remote_port,
        event_json=event_json(BindingState.BOUND, f"decode:{instance}", now, None),
        vetted=True,
    )
    outcome, _ = await c.store.put_binding(put, now)
    created = outcome is PutOutcome.CREATED
    if created:
        c.metrics.bindings_created.inc()
    tail = b'","created":true}' if created else b'","created":false}'
    return Reply(200, b'{"status":"ok","request_id":"' + spec.request_id.encode() + tail)
