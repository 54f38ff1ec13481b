"""Binding operations, independent of the web framework: the FastAPI routes, the ASGI fast path
(``bindings.fastpath``) and ``POST /v1/batch`` (``bindings.batch``) all call these, so behaviour
cannot drift between them."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from metaserver.access.principal import Principal
from metaserver.context import Context
from metaserver.errors import NotFound, StoreUnavailable
from metaserver.store.records import (
    BindingPut,
    EventPut,
    PutOutcome,
    StoredBinding,
    event_json,
    mark_json,
)
from metaserver.validation import parse_body
from pdwire.models import BindingSpec, BindingState, EventIn, MarkIn


@dataclass(frozen=True, slots=True)
class Reply:
    status: int
    body: bytes
    wait_timed_out: bool = False


async def put_binding(c: Context, who: Principal, transfer_id: str, body: bytes) -> Reply:
    return await put_spec(c, who, transfer_id, parse_body(BindingSpec, body))


async def put_spec(c: Context, who: Principal, transfer_id: str, spec: BindingSpec) -> Reply:
    who.may_bind(spec.decode_instance_id)
    now = c.clock()
    outcome, record = await c.store.put_binding(BindingPut.of(transfer_id, spec, now), now)
    if outcome is PutOutcome.CREATED:
        c.metrics.bindings_created.inc()
        return Reply(201, record.to_json())
    return Reply(200, record.to_json())


def _reached(record: StoredBinding | None, state: BindingState | None) -> bool:
    return record is not None and (state is None or record.state.rank >= state.rank)


async def get_binding(
    c: Context, transfer_id: str, wait: float | None = None, state: BindingState | None = None
) -> Reply:
    record = await c.store.get_binding(transfer_id)
    timed_out = False
    if wait is not None and not _reached(record, state):
        loop = asyncio.get_running_loop()
        deadline = loop.time() + min(wait, c.settings.max_wait_s)
        c.metrics.waiters.inc()
        unavailable: StoreUnavailable | None = None
        try:
            async with c.store.changes(transfer_id) as sub:
                record = await c.store.get_binding(transfer_id)  # closes the subscribe race
                while not _reached(record, state):
                    remaining = deadline - loop.time()
                    if remaining <= 0:
                        timed_out = True
                        break
                    if await sub.wait(remaining):
                        try:
                            record = await c.store.get_binding(transfer_id)
                            unavailable = None
                        except StoreUnavailable as exc:
                            # a Redis restart or failover: the subscription wakes every
                            # waiter once it is back, and this one reads again then
                            unavailable = exc
        finally:
            c.metrics.waiters.dec()
        if unavailable is not None:
            raise unavailable
    if record is None:
        raise NotFound(f"binding {transfer_id} not found" + (" (wait timed out)" if wait else ""))
    return Reply(200, record.to_json(), timed_out)


async def post_event(c: Context, who: Principal, transfer_id: str, body: bytes) -> Reply:
    return await apply_event(c, who, transfer_id, parse_body(EventIn, body))


async def apply_event(c: Context, who: Principal, transfer_id: str, event: EventIn) -> Reply:
    who.may_post_event(event.actor)
    now = c.clock()
    detail = None if event.detail is None else event.detail.model_dump_json(exclude_none=True)
    raw = event_json(event.state, event.actor, now, None if detail is None else detail.encode())
    put = EventPut(transfer_id, event.state, event.actor, raw, engine=who.engine)
    record = await c.store.add_event(put, now)
    c.metrics.events.labels(event.state.value).inc()
    if record.updated_at == now and record.state is event.state:  # applied, not a duplicate
        c.metrics.observe_event(event.state, record.created_at, len(record.events), now)
    return Reply(200, record.to_json())


async def post_mark(c: Context, who: Principal, transfer_id: str, body: bytes) -> Reply:
    return await apply_mark(c, who, transfer_id, parse_body(MarkIn, body))


async def apply_mark(c: Context, who: Principal, transfer_id: str, mark: MarkIn) -> Reply:
    who.may_mark()
    detail = None if mark.detail is None else mark.detail.model_dump_json(exclude_none=True)
    raw = mark_json(mark.mark, mark.actor, c.clock(), None if detail is None else detail.encode())
    await c.store.add_mark(transfer_id, mark.mark, raw)
    c.metrics.marks.labels(mark.mark.value).inc()
    return Reply(204, b"")
