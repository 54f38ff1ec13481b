"""``POST /v1/batch``: several binding writes in one request, each answered exactly as its own
request would have been, in every store."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import httpx
import pytest

from metaserver import MetaserverSettings, create_app
from metaserver.backend import memory_backend
from metaserver.store import MemoryStore
from pdwire.models import BATCH_MAX_CALLS
from tests.metaserver.test_api import AUTH, TOKEN, register, spec_json
from tests.metaserver.test_fastpath import without_fast_path

Call = dict[str, Any]


def put(tid: str, **over: Any) -> Call:
    return {"method": "PUT", "path": f"/v1/bindings/{tid}", "body": spec_json(**over)}


def event(tid: str, state: str, actor: str = "prefill-0") -> Call:
    return {
        "method": "POST",
        "path": f"/v1/bindings/{tid}/events",
        "body": {"state": state, "actor": actor},
    }


def mark(tid: str, kind: str = "first_token") -> Call:
    return {
        "method": "POST",
        "path": f"/v1/bindings/{tid}/marks",
        "body": {"mark": kind, "actor": "px"},
    }


# what a decode and a prefill instance send, plus every way a call can fail on its own
SCRIPT: list[Call] = [
    put("t1"),
    put("t2"),
    event("t1", "prefill_started"),
    event("t1", "pushing"),
    put("t1"),  # the same content again: 200
    put("t2", num_cached_tokens=0),  # different content: 409
    event("t2", "done"),  # a state may be skipped (bound -> done: P's claim failed): 200
    event("ghost", "done"),  # 404
    put("t3", decode_instance_id="nobody"),  # 422: unknown decode instance
    {"method": "PUT", "path": "/v1/bindings/t4", "body": {"block_size": 0}},  # 422
    {"method": "POST", "path": "/v1/bindings/t4", "body": {}},  # 405: not a write
    mark("t1"),  # 204
    event("t1", "done"),
]


async def _alone(api: httpx.AsyncClient, calls: list[Call]) -> list[tuple[int, Any]]:
    out = []
    for c in calls:
        r = await api.request(c["method"], c["path"], json=c["body"], headers=AUTH)
        out.append((r.status_code, r.json() if r.content else None))
    return out


def _comparable(results: list[tuple[int, Any]]) -> list[tuple[int, Any]]:
    """Status and body, without the times (each app has its own clock)."""

    def strip(body: Any) -> Any:
        if isinstance(body, dict) and "transfer_id" in body:
            return {
                "state": body["state"],
                "events": [(e["state"], e["actor"]) for e in body["events"]],
                "marks": [m["mark"] for m in body.get("marks", [])],
            }
        if isinstance(body, dict) and "not a write" in str(body.get("detail")):
            return "not a write"
        return body

    return [(s, strip(b)) for s, b in results]


async def test_batch_answers_each_call_as_its_own_request_would(
    api_factory: Callable[..., Any],
) -> None:
    alone = await api_factory(token=TOKEN)
    batched = await api_factory(token=TOKEN)
    for api in (alone, batched):
        await register(api, headers=AUTH)
    expected = await _alone(alone, SCRIPT)
    r = await batched.post("/v1/batch", json={"calls": SCRIPT}, headers=AUTH)
    assert r.status_code == 200, r.text
    got = [(x["status"], x["body"]) for x in r.json()["results"]]
    statuses = [s for s, _ in got]
    assert statuses == [201, 201, 200, 200, 200, 409, 200, 404, 422, 422, 405, 204, 200], got
    assert "not a write" in got[10][1]["detail"]
    assert expected[10] == (405, {"detail": "Method Not Allowed"})  # FastAPI's words for it
    expected[10] = (405, "not a write")
    assert _comparable(got) == _comparable(expected)
    final = (await batched.get("/v1/bindings/t1", headers=AUTH)).json()
    assert [e["state"] for e in final["events"]] == ["bound", "prefill_started", "pushing", "done"]


async def test_batch_runs_one_transfers_calls_in_their_order(api: httpx.AsyncClient) -> None:
    await register(api)
    calls = []
    for i in range(20):  # many transfers side by side, each with its own sequence
        calls += [put(f"t{i}"), event(f"t{i}", "prefill_started"), event(f"t{i}", "pushing")]
    r = await api.post("/v1/batch", json={"calls": calls})
    assert [x["status"] for x in r.json()["results"]] == [201, 200, 200] * 20
    for i in range(20):
        b = (await api.get(f"/v1/bindings/t{i}")).json()
        assert b["state"] == "pushing"


@pytest.mark.parametrize(
    ("body", "status", "where"),
    [
        ({"calls": []}, 422, "calls"),
        ({"calls": [put("t1")] * (BATCH_MAX_CALLS + 1)}, 422, "calls"),
        ({"calls": [{"method": "PUT", "path": "/v1/instances/d0", "body": {}}]}, 422, "path"),
        ({"calls": [{"method": "DELETE", "path": "/v1/bindings/t1", "body": {}}]}, 422, "method"),
        ({"calls": [{"method": "PUT", "path": "/v1/bindings/t 1", "body": {}}]}, 422, "path"),
        ({"calls": [put("t1")], "extra": 1}, 422, "extra"),
    ],
)
async def test_batch_refuses_a_malformed_batch_whole(
    api: httpx.AsyncClient, body: dict[str, Any], status: int, where: str
) -> None:
    await register(api)
    r = await api.post("/v1/batch", json=body)
    assert r.status_code == status, r.text
    assert any(where in [str(x) for x in e["loc"]] for e in r.json()["detail"]), r.text
    assert (
        await api.get("/v1/bindings/t1", headers=AUTH)
    ).status_code == 404  # nothing was written


async def test_batch_needs_the_write_token(api_factory: Callable[..., Any]) -> None:
    api = await api_factory(token=TOKEN)
    await register(api, headers=AUTH)
    r = await api.post("/v1/batch", json={"calls": [put("t1")]})
    assert r.status_code == 401
    assert (await api.get("/v1/bindings/t1", headers=AUTH)).status_code == 404


async def test_batch_fast_path_and_route_agree_and_count_calls() -> None:
    settings = MetaserverSettings()
    apps = [
        create_app(
            settings,
            backend=memory_backend(MemoryStore(binding_ttl_s=60, retain_s=60)),
            clock=lambda: 1e9,
        )
        for _ in (0, 1)
    ]
    without_fast_path(apps[1])
    bodies = []
    for app in apps:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url="http://m") as c:
            await register(c)
            r = await c.post("/v1/batch", json={"calls": SCRIPT})
            bodies.append((r.status_code, r.json()))
            metrics = (await c.get("/metrics")).text
            assert f"pdgate_metaserver_batch_calls_sum {float(len(SCRIPT))}" in metrics
    assert bodies[0] == bodies[1]
