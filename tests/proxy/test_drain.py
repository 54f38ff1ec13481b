"""Draining an instance through the proxy's admin call, end to end: two proxy replicas, a real
metaserver on a real Redis, fake vLLM servers that register themselves and write real bindings
(decode-first flow). The drain is recorded on the registration, so the replica that was not
asked honours it too; the drained instance's in-flight stream finishes; undrain restores it."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import pytest

from tests.fakes import FakeVLLM
from tests.proxy.conftest import RunningProxy, serve_proxy, wait_until
from tests.support.procs import free_port
from tests.support.services import MetaserverProcess, RedisServer

ADMIN = {"authorization": "Bearer admin-key"}
TOKENS = 12


@dataclass
class DrainCluster:
    metaserver: MetaserverProcess
    prefill: FakeVLLM
    decode: list[FakeVLLM]

    def settings(self, **over: Any) -> dict[str, Any]:
        return {
            "prefill": [self.prefill.url],
            "decode": [d.url for d in self.decode],
            "metaserver": self.metaserver.url,
            "port": free_port(),
            "health_interval_s": 0.2,
            "discovery_interval_s": 0.1,
            "backoff_base_s": 0.0,
            "admin_keys": ["admin-key"],
            **over,
        }


@pytest.fixture(scope="module")
def drain_cluster(
    redis_server: RedisServer, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[DrainCluster]:
    logs = tmp_path_factory.mktemp("drain-cluster")
    started: list[Any] = []
    try:
        ms = MetaserverProcess(redis_server.url, "--namespace", "drain", log_dir=logs)
        started.append(ms)
        p = FakeVLLM("prefill", metaserver=ms.url, log_dir=logs)
        started.append(p)
        decode = []
        for _ in range(2):
            d = FakeVLLM("decode", metaserver=ms.url, log_dir=logs)
            started.append(d)
            decode.append(d)
        yield DrainCluster(ms, p, decode)
    finally:
        for s in reversed(started):
            s.stop()


@pytest.fixture
async def replicas(drain_cluster: DrainCluster) -> AsyncIterator[list[RunningProxy]]:
    proxies = [await serve_proxy(drain_cluster.settings()) for _ in range(2)]
    try:
        yield proxies
    finally:
        for proxy in proxies:
            await proxy.stop()
        for fake in [drain_cluster.prefill, *drain_cluster.decode]:
            fake.reset()


def _drained(proxy: RunningProxy, url: str) -> bool:
    return any(i.drained for i in proxy.runtime.registry.instances() if i.url == url)


async def _served(fake: FakeVLLM) -> int:
    async with httpx.AsyncClient() as c:
        return int((await c.get(fake.url + "/_fake/stats")).json()["requests"])


async def test_drain_on_one_replica_is_honoured_by_the_other_inflight_finishes_undrain_restores(
    drain_cluster: DrainCluster, replicas: list[RunningProxy]
) -> None:
    a, b = replicas
    decode = drain_cluster.decode
    ids = {d.instance_id for d in decode}
    for proxy in replicas:  # both name their instances after the registry
        await wait_until(lambda: ids <= {i.id for i in proxy.runtime.registry.instances()})  # noqa: B023
    for d in decode:
        d.configure(token_delay_ms=150)
    client_a, client_b = a.client(), b.client()

    async def stream(client: Any) -> tuple[str, str | None]:
        text, finish = "", None
        async for chunk in await client.completions.create(
            model="m", prompt="drain me " * 20, max_tokens=TOKENS, stream=True
        ):
            text += chunk.choices[0].text
            finish = chunk.choices[0].finish_reason or finish
        return text, finish

    inflight = asyncio.create_task(stream(client_a))
    await wait_until(lambda: sum(d.stats()["active"] for d in decode) == 1)  # (other processes)
    x = next(d for d in decode if d.stats()["active"] == 1)  # the one serving it
    y = next(d for d in decode if d is not x)

    admin_a = a.http()
    r = await admin_a.post(f"/admin/instances/{x.instance_id}/drain", headers=ADMIN)
    assert r.status_code == 200, r.text
    body = r.json()
    assert (body["id"], body["draining"], body["scope"], body["url"]) == (
        x.instance_id,
        True,
        "metaserver",
        x.url,
    )
    assert body["instances"][0]["inflight"] == 1
    async with httpx.AsyncClient(base_url=drain_cluster.metaserver.url) as ms:
        registered = await ms.get(f"/v1/instances/{x.instance_id}")
    assert registered.json()["draining"] is True
    await wait_until(lambda: _drained(b, x.url), within=3)  # replica b read the registry

    before_x, before_y = await _served(x), await _served(y)
    answers = await asyncio.gather(
        *(
            c.completions.create(model="m", prompt="after the drain", max_tokens=3)
            for c in (client_a, client_b, client_a, client_b, client_a, client_b)
        )
    )
    assert [a.choices[0].text for a in answers] == ["tok0 tok1 tok2 "] * 6
    assert await _served(x) == before_x  # no new request reached the drained instance
    assert await _served(y) == before_y + 6

    text, finish = await asyncio.wait_for(inflight, 30)
    assert text == "".join(f"tok{i} " for i in range(TOKENS)) and finish == "length"
    assert x.stats()["cancelled"] == 0

    r = await b.http().delete(f"/admin/instances/{x.instance_id}/drain", headers=ADMIN)
    assert r.status_code == 200 and r.json()["draining"] is False
    await wait_until(lambda: not _drained(a, x.url), within=3)
    before_x = await _served(x)
    await asyncio.gather(*(stream(client_a) for _ in range(4)))  # least load spreads them
    assert await _served(x) > before_x


async def test_drain_errors_unknown_id_404_no_key_401(replicas: list[RunningProxy]) -> None:
    http = replicas[0].http()
    r = await http.post("/admin/instances/ghost/drain", headers=ADMIN)
    assert r.status_code == 404
    assert r.json()["error"]["message"] == (
        "instance ghost is neither registered in the metaserver nor one of this proxy's instances"
    )
    assert (await http.delete("/admin/instances/ghost/drain", headers=ADMIN)).status_code == 404
    assert (await http.post("/admin/instances/ghost/drain")).status_code == 401


async def test_drain_when_the_metaserver_is_down_is_a_503(drain_cluster: DrainCluster) -> None:
    dead = f"http://127.0.0.1:{free_port()}"
    proxy = await serve_proxy(drain_cluster.settings(metaserver=dead, flow="direct"))
    try:
        r = await proxy.http().post(
            f"/admin/instances/{drain_cluster.decode[0].instance_id}/drain", headers=ADMIN
        )
        assert r.status_code == 503
        assert r.json()["error"]["type"] == "service_unavailable"
        assert not any(i.drained for i in proxy.runtime.registry.instances())
    finally:
        await proxy.stop()
