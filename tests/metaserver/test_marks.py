"""Binding marks (``first_token``, ``end``): moments that are not states, in every store, over
the HTTP API (both the fast path and FastAPI's routes) and through the pdwire client."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable
from typing import Any

import httpx
import pytest

from metaserver.errors import NotFound
from metaserver.store import Store
from metaserver.store.records import mark_json
from pdwire.client import AsyncMetaserverClient
from pdwire.models import Binding, BindingState, MarkDetail, MarkKind
from tests.metaserver.conftest import SHORT_TTL_S, StoreTime, binding_spec, decode_instance
from tests.metaserver.test_api import AUTH, TOKEN, register, spec_json
from tests.metaserver.test_store_contract import bind, event
from tests.metaserver.test_store_contract import register as register_in_store
from tests.support.services import MetaserverProcess

S = BindingState
K = MarkKind


async def mark(
    store: Store, tid: str, kind: MarkKind, recorded: bool = True, **detail: Any
) -> Binding:
    """Add a mark, check whether the store says it was recorded, return the record."""
    raw = json.dumps(detail).encode() if detail else None
    assert await store.add_mark(tid, kind, mark_json(kind, "proxy", time.time(), raw)) is recorded
    rec = await store.get_binding(tid)
    assert rec is not None
    return Binding.model_validate_json(rec.to_json())


async def test_store_marks_kept_once_per_kind_without_touching_state(store: Store) -> None:
    await register_in_store(store)
    _, fresh = await bind(store)
    assert fresh.marks == []
    done = await event(store, "t1", S.DONE)
    first = await mark(store, "t1", K.FIRST_TOKEN, since_request_s=0.25)
    assert first.state is S.DONE and first.updated_at == done.updated_at
    assert first.events == done.events
    assert [(m.mark, m.actor) for m in first.marks] == [(K.FIRST_TOKEN, "proxy")]
    assert first.marks[0].detail == MarkDetail(since_request_s=0.25)
    await asyncio.sleep(0.01)
    again = await mark(store, "t1", K.FIRST_TOKEN, recorded=False, since_request_s=9.0)
    assert again.marks == first.marks  # the first report of a kind wins
    end = await mark(store, "t1", K.END, since_request_s=0.5, outcome="ok")
    assert [m.mark for m in end.marks] == [K.FIRST_TOKEN, K.END]
    assert end.marks[1].detail == MarkDetail(since_request_s=0.5, outcome="ok")
    rec = await store.get_binding("t1")
    assert rec is not None
    assert Binding.model_validate_json(rec.to_json()).marks == end.marks
    listed = await store.list_bindings(state=S.DONE, instance_id=None, limit=10)
    assert [Binding.model_validate_json(r.to_json()).marks for r in listed] == [end.marks]


async def test_store_marks_come_in_kind_order_whatever_the_arrival(store: Store) -> None:
    await register_in_store(store)
    await bind(store)
    await mark(store, "t1", K.END, outcome="client_disconnected")
    both = await mark(store, "t1", K.FIRST_TOKEN)
    assert [m.mark for m in both.marks] == [K.FIRST_TOKEN, K.END]


async def test_store_marks_do_not_block_later_states_or_events(store: Store) -> None:
    await register_in_store(store)
    await bind(store)
    await mark(store, "t1", K.FIRST_TOKEN)  # D recomputed: its token before P's events
    pushing = await event(store, "t1", S.PUSHING)
    failed = await event(store, "t1", S.FAILED)
    assert [e.state for e in failed.events] == [S.BOUND, S.PUSHING, S.FAILED]
    assert [m.mark for m in pushing.marks] == [m.mark for m in failed.marks] == [K.FIRST_TOKEN]


async def test_store_mark_on_missing_binding_is_not_found(store: Store) -> None:
    with pytest.raises(NotFound):
        await mark(store, "nope", K.END)


async def test_store_marks_go_with_their_binding(
    store_factory: Callable[..., Any], store_time: StoreTime
) -> None:
    store: Store = await store_factory(binding_ttl_s=SHORT_TTL_S, retain_s=30.0)
    await register_in_store(store)
    await bind(store, "short")
    await store_time.lapse(0.5 * SHORT_TTL_S)
    await mark(store, "short", K.FIRST_TOKEN)  # does not extend the binding's life
    await store_time.lapse(0.7 * SHORT_TTL_S)  # past the binding's TTL, not the mark's
    assert await store.get_binding("short") is None
    await bind(store, "gone")
    await mark(store, "gone", K.END)
    assert await store.delete_binding("gone")
    _, again = await bind(store, "gone")  # the same id bound anew starts without marks
    assert again.marks == []


async def test_api_marks_roundtrip_and_validation(api: httpx.AsyncClient) -> None:
    await register(api)
    assert (await api.put("/v1/bindings/t1", json=spec_json())).status_code == 201
    plain = (await api.get("/v1/bindings/t1")).json()
    assert "marks" not in plain  # a reader of an older release never sees the key unasked
    body = {"mark": "first_token", "actor": "proxy", "detail": {"since_request_s": 0.125}}
    r = await api.post("/v1/bindings/t1/marks", json=body)
    assert r.status_code == 204 and r.content == b"", r.text
    assert "content-length" not in r.headers and "content-type" not in r.headers
    got = Binding.model_validate((await api.get("/v1/bindings/t1")).json())
    assert got.state is S.BOUND and [m.mark for m in got.marks] == [K.FIRST_TOKEN]
    again = await api.post("/v1/bindings/t1/marks", json={**body, "detail": {}})
    assert again.status_code == 204  # the first report of a kind wins, quietly
    r = await api.post(
        "/v1/bindings/t1/marks", json={"mark": "end", "actor": "proxy", "detail": {"outcome": "ok"}}
    )
    assert r.status_code == 204
    listed = (await api.get("/v1/bindings", params={"state": "bound"})).json()["bindings"]
    assert [m["mark"] for m in listed[0]["marks"]] == ["first_token", "end"]
    assert listed[0]["marks"][1]["detail"] == {"outcome": "ok"}
    for bad in (
        {"mark": "second_token", "actor": "proxy"},
        {"mark": "end"},
        {"mark": "end", "actor": "proxy", "extra": 1},
        {"mark": "end", "actor": "proxy", "detail": {"since_request_s": -1}},
        {"mark": "end", "actor": "proxy", "detail": {"chunks": -1}},
        {"state": "done", "actor": "proxy"},
    ):
        r = await api.post("/v1/bindings/t1/marks", json=bad)
        assert r.status_code == 422, (bad, r.text)
    r = await api.post("/v1/bindings/nope/marks", json={"mark": "end", "actor": "proxy"})
    assert r.status_code == 404
    r = await api.post("/v1/bindings/bad id!/marks", json={"mark": "end", "actor": "proxy"})
    assert r.status_code == 422  # not a transfer id: FastAPI's route answers
    after = Binding.model_validate((await api.get("/v1/bindings/t1")).json())
    assert [m.mark for m in after.marks] == [K.FIRST_TOKEN, K.END] and after.state is S.BOUND


async def test_api_marks_need_the_write_token(api_factory: Callable[..., Any]) -> None:
    api: httpx.AsyncClient = await api_factory(token=TOKEN)
    await register(api, headers=AUTH)
    assert (await api.put("/v1/bindings/t1", json=spec_json(), headers=AUTH)).status_code == 201
    body = {"mark": "end", "actor": "proxy"}
    assert (await api.post("/v1/bindings/t1/marks", json=body)).status_code == 401
    r = await api.post("/v1/bindings/t1/marks", json=body, headers=AUTH)
    assert r.status_code == 204
    got = (await api.get("/v1/bindings/t1", headers=AUTH)).json()
    assert [m["mark"] for m in got["marks"]] == ["end"]


async def test_client_post_mark_against_a_metaserver_process(
    metaserver_factory: Callable[..., MetaserverProcess],
) -> None:
    ms = metaserver_factory("memory", "--token", TOKEN)
    async with AsyncMetaserverClient(ms.url, token=TOKEN) as client:
        await client.put_instance("decode-0", decode_instance())
        await client.put_binding("t1", binding_spec())
        await client.post_mark("t1", K.FIRST_TOKEN, "proxy", MarkDetail(since_request_s=0.5))
        got = await client.get_binding("t1")
        assert [(m.mark, m.detail) for m in got.marks] == [
            (K.FIRST_TOKEN, MarkDetail(since_request_s=0.5))
        ]
