"""Drains in memory: the registry's drain rules, selection through ``tests.proxy.mock``, and the
``/admin`` calls over ASGI (a runtime that is never started: local drains only). The drain
through a real metaserver, seen by a second proxy replica, is in ``test_drain.py``."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import httpx
import pytest

from pdwire.models import Instance as Registered
from proxy import ProxySettings, create_app
from proxy.config import Flow
from proxy.errors import BadRequest, NotFound
from proxy.instances import Registry, Role
from tests.proxy.inmemory import D_URL, SSE, InMemoryProxy, sse_text
from tests.proxy.mock import MockBackend, Outcome, Reply

D2_URL = "http://d1:8201"


def registered(iid: str, url: str, draining: bool = False) -> Registered:
    now = time.time()
    return Registered(
        instance_id=iid,
        role="decode",
        url=url,
        registered_at=now,
        last_heartbeat=now,
        expires_at=now + 30,
        draining=draining,
    )


def test_registry_drain_from_the_registry_names_instances_and_holds_until_registered_again() -> (
    None
):
    reg = Registry()
    reg.reconcile(Role.DECODE, ["http://a:1", "http://b:2"])
    a, b = sorted(reg.all(Role.DECODE), key=lambda i: i.url)
    assert (a.id, b.id) == ("a:1", "b:2")  # not in the registry: host:port
    reg.apply_registry([registered("dec-a", "http://a:1", True), registered("dec-b", "http://b:2")])
    assert (a.id, b.id) == ("dec-a", "dec-b")
    assert a.drained_remote and not a.available() and b.available()
    assert [i.url for i in reg.available(Role.DECODE)] == ["http://b:2"]
    assert reg.find("dec-a") == [a]
    # a deregisters (shutting down): still drained while this proxy knows its URL
    reg.apply_registry([registered("dec-b", "http://b:2")])
    assert a.drained_remote and a.id == "dec-a"
    # a registers again undrained (a restart): selected again
    reg.apply_registry([registered("dec-a", "http://a:1"), registered("dec-b", "http://b:2")])
    assert not a.drained and a.available()
    # a drain holds for an instance that discovery adds later, and panic routing skips it
    reg.apply_registry([registered("dec-c", "http://c:3", True)])
    reg.reconcile(Role.DECODE, ["http://a:1", "http://b:2", "http://c:3"])
    c = reg.find("dec-c")[0]
    assert c.drained_remote and not c.available()
    c.healthy, c.slow = False, True
    assert c not in reg.panic(Role.DECODE)
    # a drained URL neither registered nor known any more is forgotten
    reg.reconcile(Role.DECODE, ["http://a:1", "http://b:2"])
    reg.sweep()
    reg.apply_registry([])
    reg.reconcile(Role.DECODE, ["http://a:1", "http://b:2", "http://c:3"])
    assert not reg.find("c:3")[0].drained


def test_registry_local_drain_and_undrain() -> None:
    reg = Registry()
    reg.reconcile(Role.DECODE, ["http://a:1"])
    reg.reconcile(Role.PREFILL, ["http://a:1"])  # one server in both pools
    both = reg.find("a:1")
    assert len(both) == 2
    reg.drain_local({"http://a:1"}, True)
    assert all(i.drained_local and not i.available() for i in both)
    assert both[0].describe()["drained_by"] == ["proxy"]
    reg.drain_local({"http://a:1"}, False)
    assert all(i.available() for i in both)


async def test_drained_decode_gets_no_new_requests_its_inflight_one_finishes() -> None:
    gate = asyncio.Event()
    backend = MockBackend({(D_URL, "decode"): Reply.sse(["Hello", gate, " world"]), "decode": SSE})
    px = InMemoryProxy(backend, Flow.DIRECT, decode=[D_URL, D2_URL])
    drains = px.runtime.drains
    d1 = px.runtime.registry.find("d1:8201")[0]
    await drains.set("d1:8201", True)  # so that the first request lands on d0
    first = px.request(stream=True)
    await backend.called("decode", waiting=True)
    await drains.set("d1:8201", False)
    result = await drains.set("d0:8200", True)
    assert (result.scope, result.url, result.draining) == ("proxy", D_URL, True)
    d0 = result.instances[0]
    assert d0.inflight == 1 and not d0.available()
    for _ in range(3):
        ex = await px.send(stream=True)
        assert ex.status == 200 and sse_text(ex.body) == "Hello world"
    assert [c.url for c in backend.calls_of("decode")] == [D_URL, D2_URL, D2_URL, D2_URL]
    assert d1.served == 3
    gate.set()
    await first.done()
    assert first.status == 200 and sse_text(first.body) == "Hello world"
    assert backend.calls_of("decode", D_URL)[0].outcome is Outcome.RELEASED
    assert d0.inflight == 0 and d0 in px.runtime.registry.all(Role.DECODE)  # still known
    # undrained, and the other one drained: the next request goes to d0 again
    backend.route((D_URL, "decode"), SSE)
    await drains.set("d0:8200", False)
    await drains.set("d1:8201", True)
    ex = await px.send(stream=True)
    assert ex.status == 200 and backend.calls_of("decode")[-1].url == D_URL
    await px.settle()


async def test_every_instance_drained_is_a_503_not_a_hang() -> None:
    px = InMemoryProxy(MockBackend({"decode": SSE}), Flow.DIRECT)
    await px.runtime.drains.set("d0:8200", True)
    ex = await px.send()
    assert ex.status == 503 and ex.headers[b"retry-after"] == b"1"
    assert "no decode instance available" in ex.json()["error"]["message"]
    await px.settle()


async def test_drain_of_an_unknown_or_malformed_id_is_refused() -> None:
    px = InMemoryProxy(MockBackend())
    with pytest.raises(NotFound, match="ghost is not one of this proxy's instances"):
        await px.runtime.drains.set("ghost", True)
    with pytest.raises(BadRequest):
        await px.runtime.drains.set("not an id", True)
    assert all(i.available() for i in px.runtime.registry.instances())


def _admin_app(**settings: Any) -> tuple[httpx.AsyncClient, Any]:
    config: dict[str, Any] = {"flow": "direct", "decode": [D_URL, D2_URL], **settings}
    app = create_app(ProxySettings(**config))
    app.runtime.registry.reconcile(Role.DECODE, config["decode"])  # no lifespan: no discovery
    client = httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url="http://proxy")
    return client, app


async def test_admin_drain_calls_answer_and_are_protected() -> None:
    client, app = _admin_app(api_keys=["client-key"], admin_keys=["admin-key"])
    admin = {"authorization": "Bearer admin-key"}
    async with client:
        r = await client.post("/admin/instances/d1:8201/drain")
        assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
        r = await client.post(
            "/admin/instances/d1:8201/drain", headers={"authorization": "Bearer client-key"}
        )
        assert r.status_code == 401  # a client key is not an admin key
        r = await client.post("/admin/instances/d1:8201/drain", headers=admin)
        assert r.status_code == 200
        body = r.json()
        assert (body["id"], body["draining"], body["scope"]) == ("d1:8201", True, "proxy")
        assert body["instances"][0]["drained_by"] == ["proxy"]
        client_view = await client.get(
            "/v1/instances", headers={"authorization": "Bearer client-key"}
        )
        assert client_view.status_code == 401  # internal addresses: the operator's view
        listed = await client.get("/v1/instances", headers=admin)
        drained = {i["id"]: i["drained"] for i in listed.json()["instances"]}
        assert drained == {"d0:8200": False, "d1:8201": True}
        r = await client.delete("/admin/instances/d1:8201/drain", headers=admin)
        assert r.status_code == 200 and r.json()["draining"] is False
        assert all(i.available() for i in app.runtime.registry.instances())
        r = await client.post("/admin/instances/ghost/drain", headers=admin)
        assert r.status_code == 404
        assert r.json()["error"] == {
            "message": "instance ghost is not one of this proxy's instances",
            "type": "not_found_error",
            "param": None,
            "code": 404,
        }
        r = await client.delete("/admin/instances/bad%20id/drain", headers=admin)
        assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"


async def test_admin_calls_are_off_without_an_admin_key() -> None:
    # before: the client keys opened /admin, so any client could drain every instance
    for settings in ({"api_keys": ["client-key"]}, {}):
        client, app = _admin_app(**settings)
        async with client:
            for auth in ({}, {"authorization": "Bearer client-key"}):
                r = await client.post("/admin/instances/d0:8200/drain", headers=auth)
                assert r.status_code == 403
                assert r.json()["error"]["type"] == "permission_error"
                assert "--admin-key" in r.json()["error"]["message"]
            listed = await client.get(
                "/v1/instances", headers={"authorization": "Bearer client-key"}
            )
            assert listed.status_code == 403  # the operator's view is off too
        assert all(i.available() for i in app.runtime.registry.instances())


def test_an_admin_key_must_differ_from_the_client_keys() -> None:
    with pytest.raises(ValueError, match="--admin-key must differ from every --api-key"):
        ProxySettings(flow="direct", decode=[D_URL], api_keys=["k1", "k2"], admin_keys=["k2"])
