"""The HTTP surface, in-process over ASGI, against both stores."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from metaserver import MetaserverSettings, create_app
from metaserver.backend import memory_backend
from metaserver.store import MemoryStore
from pdwire.models import Binding, Instance
from tests.metaserver.conftest import at, binding_spec, decode_instance
from tests.support.clock import virtual_time

TOKEN = "s3cret"
AUTH = {"authorization": f"Bearer {TOKEN}"}


def spec_json(**over: Any) -> dict[str, Any]:
    return json.loads(binding_spec(**over).model_dump_json())


def instance_json(**over: Any) -> dict[str, Any]:
    return json.loads(decode_instance(**over).model_dump_json())


async def register(api: httpx.AsyncClient, iid: str = "decode-0", headers: Any = None) -> None:
    r = await api.put(f"/v1/instances/{iid}", json=instance_json(**at(iid)), headers=headers)
    assert r.status_code in (200, 201), r.text


async def test_api_put_binding_201_then_200_then_409(api: httpx.AsyncClient) -> None:
    await register(api)
    r = await api.put("/v1/bindings/t1", json=spec_json())
    assert r.status_code == 201
    created = Binding.model_validate(r.json())
    assert created.transfer_id == "t1" and created.state == "bound"
    r = await api.put("/v1/bindings/t1", json=spec_json())
    assert r.status_code == 200
    assert Binding.model_validate(r.json()) == created
    r = await api.put("/v1/bindings/t1", json=spec_json(num_cached_tokens=0))
    assert r.status_code == 409
    assert "different content" in r.json()["detail"]


async def test_api_binding_to_unregistered_instance_is_422(api: httpx.AsyncClient) -> None:
    r = await api.put("/v1/bindings/t1", json=spec_json())
    assert r.status_code == 422
    assert "not registered" in r.json()["detail"]
    assert (await api.get("/v1/bindings/t1")).status_code == 404


@pytest.mark.parametrize(
    "mutate",
    [
        lambda b: b.update(extra_field=1),
        lambda b: b.pop("block_ids"),
        lambda b: b.update(block_ids=[]),
        lambda b: b.update(block_size=0),
        lambda b: b.update(num_cached_tokens=99),
        lambda b: b.update(block_ids=[list(range(10))]),
        lambda b: b["kv_endpoint"].update(port=70000),
        lambda b: b["kv_endpoint"].update(host="bad host"),
        lambda b: b.update(request_id=""),
    ],
    ids=[
        "unknown-field",
        "missing",
        "no-groups",
        "zero-block",
        "cached>prompt",
        "too-many-blocks",
        "bad-port",
        "bad-host",
        "empty-id",
    ],
)
async def test_api_invalid_binding_body_is_422(
    api: httpx.AsyncClient, mutate: Callable[[dict[str, Any]], None]
) -> None:
    await register(api)
    body = spec_json()
    mutate(body)
    r = await api.put("/v1/bindings/t1", json=body)
    assert r.status_code == 422, r.text
    assert isinstance(r.json()["detail"], list)
    assert (await api.get("/v1/bindings/t1")).status_code == 404


async def test_api_malformed_json_is_422_and_bad_ids_rejected(api: httpx.AsyncClient) -> None:
    await register(api)
    r = await api.put("/v1/bindings/t1", content=b"{not json")
    assert r.status_code == 422
    r = await api.put("/v1/bindings/bad%20id", json=spec_json())
    assert r.status_code == 422
    r = await api.put("/v1/bindings/" + "x" * 129, json=spec_json())
    assert r.status_code == 422


async def test_api_body_over_limit_is_413(api_factory: Callable[..., Any]) -> None:
    api: httpx.AsyncClient = await api_factory(max_body_bytes=2048)
    await register(api)
    body = spec_json(num_prompt_tokens=10_000, block_ids=[list(range(600))])
    r = await api.put("/v1/bindings/t1", json=body)
    assert r.status_code == 413
    assert "exceeds 2048 bytes" in r.json()["detail"]

    async def chunks() -> Any:  # no content-length: the streamed size is what counts
        for _ in range(10):
            yield b" " * 1000

    r = await api.put("/v1/bindings/t1", content=chunks())
    assert r.status_code == 413
    assert (await api.get("/v1/bindings/t1")).status_code == 404


async def test_api_writes_need_token_reads_open_when_asked(
    api_factory: Callable[..., Any],
) -> None:
    api: httpx.AsyncClient = await api_factory(token=TOKEN, protect_reads=False)
    r = await api.put("/v1/instances/decode-0", json=instance_json())
    assert r.status_code == 401
    r = await api.put(
        "/v1/instances/decode-0", json=instance_json(), headers={"authorization": "Bearer wrong"}
    )
    assert r.status_code == 401
    await register(api, headers=AUTH)
    assert (await api.put("/v1/bindings/t1", json=spec_json())).status_code == 401
    assert (await api.put("/v1/bindings/t1", json=spec_json(), headers=AUTH)).status_code == 201
    ev = {"state": "done", "actor": "p"}
    assert (await api.post("/v1/bindings/t1/events", json=ev)).status_code == 401
    assert (await api.delete("/v1/bindings/t1")).status_code == 401
    assert (await api.delete("/v1/instances/decode-0")).status_code == 401
    assert (await api.get("/v1/bindings/t1")).status_code == 200
    assert (await api.get("/v1/instances")).status_code == 200
    assert (await api.get("/v1/bindings/t1")).json()["state"] == "bound"


async def test_api_reads_are_protected_by_default(api_factory: Callable[..., Any]) -> None:
    api: httpx.AsyncClient = await api_factory(token=TOKEN)
    await register(api, headers=AUTH)
    assert (await api.get("/v1/instances")).status_code == 401
    assert (await api.get("/v1/instances", headers=AUTH)).status_code == 200
    assert (await api.get("/v1/stats")).status_code == 401
    assert (await api.get("/health")).status_code == 200


async def test_api_events_and_history(api: httpx.AsyncClient) -> None:
    await register(api)
    await api.put("/v1/bindings/t1", json=spec_json())
    for state, detail in (
        ("prefill_started", None),
        ("pushing", {"bytes_pushed": 4096}),
        ("done", {"blocks_pushed": 3}),
    ):
        body: dict[str, Any] = {"state": state, "actor": "prefill-0"}
        if detail:
            body["detail"] = detail
        r = await api.post("/v1/bindings/t1/events", json=body)
        assert r.status_code == 200, r.text
    b = Binding.model_validate((await api.get("/v1/bindings/t1")).json())
    assert [e.state for e in b.events] == ["bound", "prefill_started", "pushing", "done"]
    assert b.events[2].detail is not None and b.events[2].detail.bytes_pushed == 4096
    assert all(b.events[i].at <= b.events[i + 1].at for i in range(3))
    r = await api.post("/v1/bindings/t1/events", json={"state": "pushing", "actor": "x"})
    assert r.status_code == 409 and "is done" in r.json()["detail"]
    r = await api.post("/v1/bindings/none/events", json={"state": "done", "actor": "x"})
    assert r.status_code == 404
    r = await api.post("/v1/bindings/t1/events", json={"state": "sideways", "actor": "x"})
    assert r.status_code == 422


async def test_api_long_poll_wakes_on_write(api: httpx.AsyncClient) -> None:
    await register(api)
    # a wait far past the test's (an hour, capped at max_wait_s: 120 s): the write must end it
    # (right: milliseconds after the write; wrong: 120 s), whatever the machine's scheduling
    waiter = asyncio.create_task(api.get("/v1/bindings/t1", params={"wait": 3600}))
    await asyncio.sleep(0.2)
    assert not waiter.done()
    await api.put("/v1/bindings/t1", json=spec_json())
    r = await asyncio.wait_for(waiter, 30)
    assert r.status_code == 200 and r.json()["state"] == "bound"
    assert "x-pdgate-wait" not in r.headers  # woken by the write, not by its timeout


async def test_api_long_poll_for_state(api: httpx.AsyncClient) -> None:
    await register(api)
    await api.put("/v1/bindings/t1", json=spec_json())
    waiter = asyncio.create_task(api.get("/v1/bindings/t1", params={"wait": 10, "state": "done"}))
    await asyncio.sleep(0.1)
    await api.post("/v1/bindings/t1/events", json={"state": "pushing", "actor": "p"})
    await asyncio.sleep(0.1)
    assert not waiter.done()
    await api.post("/v1/bindings/t1/events", json={"state": "failed", "actor": "p"})
    r = await asyncio.wait_for(waiter, 5)
    assert r.json()["state"] == "failed"  # a terminal state ends the wait too


async def test_api_long_poll_timeouts(api: httpx.AsyncClient) -> None:
    """What a long poll that times out answers, on every store (how long it waited: below)."""
    await register(api)
    started = time.monotonic()
    r = await api.get("/v1/bindings/t1", params={"wait": 0.3})
    assert r.status_code == 404 and "wait timed out" in r.json()["detail"]
    assert time.monotonic() - started >= 0.3  # never sooner than asked
    await api.put("/v1/bindings/t1", json=spec_json())
    r = await api.get("/v1/bindings/t1", params={"wait": 0.2, "state": "done"})
    assert r.status_code == 200 and r.json()["state"] == "bound"
    assert r.headers["x-pdgate-wait"] == "timeout"
    assert (await api.get("/v1/bindings/t1", params={"wait": -1})).status_code == 422


@virtual_time
async def test_api_long_poll_lasts_what_it_asked() -> None:
    """On the loop's clock (virtual: exact however the machine schedules the test) a long poll
    that nothing wakes lasts its ``wait``, and at most the server's ``max_wait_s``."""
    loop = asyncio.get_running_loop()
    store = MemoryStore(binding_ttl_s=60.0, retain_s=120.0, clock=time.time)
    await store.start()
    app = create_app(MetaserverSettings(max_wait_s=5.0), backend=memory_backend(store))
    try:
        async with httpx.AsyncClient(
            transport=httpx.ASGITransport(app), base_url="http://ms"
        ) as api:
            await register(api)
            for wait, lasted in ((0.3, 0.3), (2.5, 2.5), (60.0, 5.0)):
                started = loop.time()
                r = await api.get("/v1/bindings/t1", params={"wait": wait})
                assert r.status_code == 404 and "wait timed out" in r.json()["detail"]
                assert loop.time() - started == pytest.approx(lasted, abs=1e-6), wait
    finally:
        await store.close()


async def test_api_list_and_delete(api: httpx.AsyncClient) -> None:
    await register(api)
    for i in range(3):
        await api.put(f"/v1/bindings/t{i}", json=spec_json())
        await asyncio.sleep(0.002)
    await api.post("/v1/bindings/t1/events", json={"state": "aborted", "actor": "proxy"})
    body = (await api.get("/v1/bindings")).json()
    assert body["count"] == 3 and [b["transfer_id"] for b in body["bindings"]] == ["t2", "t1", "t0"]
    body = (await api.get("/v1/bindings", params={"state": "aborted"})).json()
    assert [b["transfer_id"] for b in body["bindings"]] == ["t1"]
    body = (await api.get("/v1/bindings", params={"instance": "other"})).json()
    assert body == {"count": 0, "bindings": []}
    assert (await api.get("/v1/bindings", params={"limit": 0})).status_code == 422
    assert (await api.delete("/v1/bindings/t0")).status_code == 204
    assert (await api.delete("/v1/bindings/t0")).status_code == 404


async def test_api_instances(api: httpx.AsyncClient) -> None:
    r = await api.put("/v1/instances/decode-0", json=instance_json(model="tiny", version="0.32.0"))
    assert r.status_code == 201
    inst = Instance.model_validate(r.json())
    assert inst.expires_at > inst.last_heartbeat
    r = await api.put("/v1/instances/decode-0", json=instance_json(model="tiny", version="0.32.0"))
    assert r.status_code == 200
    p0 = instance_json(role="prefill", kv_endpoint=None, url="http://10.0.0.8:8100")
    r = await api.put("/v1/instances/p-0", json=p0)
    assert r.status_code == 201
    listed = (await api.get("/v1/instances")).json()
    assert [i["instance_id"] for i in listed["instances"]] == ["decode-0", "p-0"]
    listed = (await api.get("/v1/instances", params={"role": "prefill"})).json()
    assert [i["instance_id"] for i in listed["instances"]] == ["p-0"]
    assert (await api.get("/v1/instances/p-0")).json()["role"] == "prefill"
    assert (
        await api.put("/v1/instances/x", json={"role": "judge", "url": "http://x"})
    ).status_code == 422
    assert (
        await api.put("/v1/instances/x", json={"role": "decode", "url": "ftp://x"})
    ).status_code == 422
    assert (await api.delete("/v1/instances/p-0")).status_code == 204
    assert (await api.get("/v1/instances/p-0")).status_code == 404


async def test_api_instance_revision_and_kv_identity_are_kept_only_when_sent(
    api: httpx.AsyncClient,
) -> None:
    """An engine's revision and KV identity come back as sent; a record without them has no
    such keys, so a reader from before these fields still parses it."""
    kv = {
        "model": "sha256:" + "c" * 32,
        "dtype": "bfloat16",
        "kv_cache_dtype": "fp8",
        "block_size": 16,
        "head_size": 128,
        "num_kv_heads": 8,
        "num_layers": 32,
        "use_mla": False,
        "protocol": 1,
    }
    body = instance_json() | {"revision": "llama@v2", "kv": kv}
    assert (await api.put("/v1/instances/decode-0", json=body)).status_code == 201
    got = (await api.get("/v1/instances/decode-0")).json()
    assert got["revision"] == "llama@v2" and got["kv"] == kv
    one = instance_json(**at("decode-1"))
    assert (await api.put("/v1/instances/decode-1", json=one)).status_code == 201
    plain = (await api.get("/v1/instances/decode-1")).json()
    assert "revision" not in plain and "kv" not in plain
    bad = instance_json() | {"revision": "has space"}
    assert (await api.put("/v1/instances/decode-2", json=bad)).status_code == 422
    short = instance_json() | {"kv": {**kv, "model": "x"}}
    assert (await api.put("/v1/instances/decode-2", json=short)).status_code == 422


async def test_api_drain_and_undrain_an_instance(api_factory: Callable[..., Any]) -> None:
    api = await api_factory(token=TOKEN)
    await register(api, headers=AUTH)
    await register(api, "decode-1", headers=AUTH)
    assert (await api.put("/v1/instances/decode-0/drain")).status_code == 401
    r = await api.put("/v1/instances/decode-0/drain", headers=AUTH)
    assert r.status_code == 200
    assert Instance.model_validate(r.json()).draining is True
    await register(api, headers=AUTH)  # heartbeat
    listed = (await api.get("/v1/instances", headers=AUTH)).json()["instances"]
    assert {i["instance_id"]: i["draining"] for i in listed} == {
        "decode-0": True,
        "decode-1": False,
    }
    assert (await api.get("/v1/instances/decode-0", headers=AUTH)).json()["draining"] is True
    r = await api.put("/v1/instances/decode-0/drain", headers=AUTH)  # idempotent
    assert r.status_code == 200 and r.json()["draining"] is True
    r = await api.delete("/v1/instances/decode-0/drain", headers=AUTH)
    assert r.status_code == 200 and r.json()["draining"] is False
    assert (await api.get("/v1/instances/decode-0", headers=AUTH)).json()["draining"] is False
    r = await api.put("/v1/instances/ghost/drain", headers=AUTH)
    assert r.status_code == 404 and "ghost not registered" in r.text
    assert (await api.delete("/v1/instances/ghost/drain", headers=AUTH)).status_code == 404
    assert (await api.put("/v1/instances/bad%20id/drain", headers=AUTH)).status_code == 422


async def test_api_stats_health_ready_metrics(api: httpx.AsyncClient) -> None:
    await register(api)
    await api.put("/v1/bindings/a", json=spec_json())
    await api.put("/v1/bindings/b", json=spec_json())
    await api.post("/v1/bindings/a/events", json={"state": "done", "actor": "p"})
    stats = (await api.get("/v1/stats")).json()
    assert stats["bindings_by_state"]["done"] == 1 and stats["bindings_by_state"]["bound"] == 1
    assert stats["bound_to_done_samples"] == 1 and stats["bound_to_done_ms"]["p50"] >= 0
    assert stats["instances_by_role"] == {"decode": 1}
    assert (await api.get("/health")).json() == {"status": "ok"}
    ready = (await api.get("/ready")).json()
    assert ready["status"] == "ready"
    metrics = (await api.get("/metrics")).text
    assert "pdgate_metaserver_bindings_created_total 2.0" in metrics
    assert 'pdgate_metaserver_binding_events_total{state="done"} 1.0' in metrics
    assert 'route="/v1/bindings/{transfer_id}"' in metrics


async def test_api_metrics_time_the_phases_and_count_transfers_in_flight(
    api_factory: Callable[..., Any],
) -> None:
    api: httpx.AsyncClient = await api_factory(metrics_scan_interval_s=0)  # every read scans

    def sample(text: str, name: str, **labels: str) -> float:
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                if s.name == name and s.labels == labels:
                    return float(s.value)
        raise AssertionError(f"{name} {labels} not on /metrics")

    await register(api)
    for tid in ("a", "b", "c"):
        await api.put(f"/v1/bindings/{tid}", json=spec_json())
    text = (await api.get("/metrics")).text
    assert sample(text, "pdgate_metaserver_transfers_in_flight", state="bound") == 3
    assert sample(text, "pdgate_metaserver_transfer_oldest_age_seconds") > 0
    assert sample(text, "pdgate_metaserver_prefill_queue_seconds_count") == 0
    for tid, states in (("a", ["prefill_started", "pushing", "done"]), ("b", ["pushing"])):
        for state in states:
            r = await api.post(f"/v1/bindings/{tid}/events", json={"state": state, "actor": "p"})
            assert r.status_code == 200
    # duplicates change nothing
    await api.post("/v1/bindings/a/events", json={"state": "done", "actor": "p"})
    await api.post("/v1/bindings/b/events", json={"state": "pushing", "actor": "p"})
    await api.post("/v1/bindings/c/events", json={"state": "aborted", "actor": "proxy"})
    text = (await api.get("/metrics")).text
    # P started on "a" (prefill_started) and on "b" (its first event was pushing)
    assert sample(text, "pdgate_metaserver_prefill_queue_seconds_count") == 2
    assert sample(text, "pdgate_metaserver_transfer_seconds_count", outcome="done") == 1
    assert sample(text, "pdgate_metaserver_transfer_seconds_count", outcome="aborted") == 1
    assert sample(text, "pdgate_metaserver_transfers_in_flight", state="pushing") == 1
    assert sample(text, "pdgate_metaserver_transfers_in_flight", state="bound") == 0
    await api.post("/v1/bindings/b/events", json={"state": "failed", "actor": "p"})
    text = (await api.get("/metrics")).text
    assert sample(text, "pdgate_metaserver_transfers_in_flight", state="pushing") == 0
    assert sample(text, "pdgate_metaserver_transfer_oldest_age_seconds") == 0


async def test_api_openapi_documents_bodies(api: httpx.AsyncClient) -> None:
    schema = (await api.get("/openapi.json")).json()
    put = schema["paths"]["/v1/bindings/{transfer_id}"]["put"]
    ref = put["requestBody"]["content"]["application/json"]["schema"]["$ref"]
    assert ref == "#/components/schemas/BindingSpec"
    assert "block_ids" in schema["components"]["schemas"]["BindingSpec"]["properties"]
    assert (await api.get("/docs")).status_code == 200
