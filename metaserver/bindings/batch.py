"""``POST /v1/batch``: several binding writes in one request.

Each call is served by the very function its own request would reach (``bindings.service``)
and answered with the status and body that request would have had, so a batch changes the cost
of the writes, not their meaning. Calls about one transfer run one after another, in their
order; calls about different transfers run side by side (with Redis, the store pipelines them).
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Awaitable, Callable
from typing import Any

from metaserver.access.principal import Principal
from metaserver.bindings import service
from metaserver.context import Context
from metaserver.errors import MetaserverError
from metaserver.problems import render_problem
from metaserver.validation import BodyInvalid, parse_body, parse_obj
from pdwire.models import BatchCall, BatchIn, BindingSpec, EventIn, MarkIn

log = logging.getLogger("pdgate.metaserver")

_PREFIX = "/v1/bindings/"


async def _put(c: Context, who: Principal, transfer_id: str, body: dict[str, Any]) -> service.Reply:
    return await service.put_spec(c, who, transfer_id, parse_obj(BindingSpec, body))


async def _event(
    c: Context, who: Principal, transfer_id: str, body: dict[str, Any]
) -> service.Reply:
    return await service.apply_event(c, who, transfer_id, parse_obj(EventIn, body))


async def _mark(
    c: Context, who: Principal, transfer_id: str, body: dict[str, Any]
) -> service.Reply:
    return await service.apply_mark(c, who, transfer_id, parse_obj(MarkIn, body))


# each call's body is validated as its own request's would be, from the decoded batch (not
# serialised again): the same model, the same 422 shape
_WRITES: dict[
    tuple[str, str], Callable[[Context, Principal, str, dict[str, Any]], Awaitable[service.Reply]]
] = {("PUT", ""): _put, ("POST", "events"): _event, ("POST", "marks"): _mark}


def _split(path: str) -> tuple[str, str]:
    """``/v1/bindings/{id}[/events|/marks]`` → (id, ``""`` | ``events`` | ``marks``); the
    model's pattern has already checked the shape."""
    transfer_id, _, what = path[len(_PREFIX) :].partition("/")
    return transfer_id, what


async def _one(c: Context, who: Principal, call: BatchCall) -> tuple[int, bytes]:
    transfer_id, what = _split(call.path)
    write = _WRITES.get((call.method, what))
    if write is None:
        detail = f"{call.method} {call.path} is not a write (PUT a binding, POST events or marks)"
        return 405, json.dumps({"detail": detail}).encode()
    try:
        reply = await write(c, who, transfer_id, call.body)
    except (MetaserverError, BodyInvalid) as exc:
        status, payload, _ = render_problem(exc, c.metrics)
        return status, payload
    except Exception:
        log.exception("batch: %s %s failed", call.method, call.path)
        return 500, b'{"detail":"internal error"}'
    return reply.status, reply.body


async def run(c: Context, who: Principal, body: bytes) -> service.Reply:
    calls = parse_body(BatchIn, body).calls
    results: list[tuple[int, bytes]] = [(0, b"")] * len(calls)
    by_transfer: dict[str, list[int]] = {}
    for i, call in enumerate(calls):
        by_transfer.setdefault(_split(call.path)[0], []).append(i)

    async def in_order(indexes: list[int]) -> None:
        for i in indexes:
            results[i] = await _one(c, who, calls[i])

    await asyncio.gather(*(in_order(indexes) for indexes in by_transfer.values()))
    c.metrics.batch_calls.observe(len(calls))
    items = b",".join(b'{"status":%d,"body":%s}' % (s, p or b"null") for s, p in results)
    return service.Reply(200, b'{"results":[' + items + b"]}")
