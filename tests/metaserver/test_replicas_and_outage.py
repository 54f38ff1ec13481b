"""Real pd-metaserver processes over a real redis-server: replicas share state and wake each
other's long-polls; a Redis crash gives 503s, then everything recovers with no acknowledged
binding lost."""

from __future__ import annotations

import asyncio
import signal
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest

from tests.metaserver.test_api import instance_json, spec_json
from tests.support.procs import VENV_BIN
from tests.support.services import MetaserverProcess, RedisSentinelGroup, RedisServer

pytestmark = (
    pytest.mark.slow
)  # Redis replicas, Sentinel and metaserver processes: not in `make test-fast`


async def test_replicas_long_poll_wakes_on_write_through_other_replica(
    redis_server: RedisServer, metaserver_factory: Callable[..., MetaserverProcess]
) -> None:
    ns = ("--namespace", f"rep{time.monotonic_ns()}")
    a = metaserver_factory(redis_server.url, *ns)
    b = metaserver_factory(redis_server.url, *ns)
    async with httpx.AsyncClient(timeout=30) as http:
        assert (
            await http.put(f"{b.url}/v1/instances/decode-0", json=instance_json())
        ).status_code == 201
        # the registration made through B is visible through A
        assert (await http.get(f"{a.url}/v1/instances/decode-0")).status_code == 200
        started = time.monotonic()
        waiter = asyncio.create_task(http.get(f"{a.url}/v1/bindings/x1", params={"wait": 20}))
        await asyncio.sleep(0.3)
        assert not waiter.done()
        r = await http.put(f"{b.url}/v1/bindings/x1", json=spec_json())
        assert r.status_code == 201
        got = await asyncio.wait_for(waiter, 10)
        woke_after = time.monotonic() - started
        assert got.status_code == 200 and got.json()["transfer_id"] == "x1"
        assert woke_after < 5, f"long-poll took {woke_after:.1f}s: not woken by the write"
        # and a state wait on B is woken by an event posted through A
        waiter = asyncio.create_task(
            http.get(f"{b.url}/v1/bindings/x1", params={"wait": 20, "state": "done"})
        )
        await asyncio.sleep(0.3)
        await http.post(f"{a.url}/v1/bindings/x1/events", json={"state": "done", "actor": "p"})
        got = await asyncio.wait_for(waiter, 10)
        assert got.json()["state"] == "done"


async def test_redis_crash_gives_503_then_recovers_without_losing_bindings(
    private_redis: RedisServer, metaserver_factory: Callable[..., MetaserverProcess]
) -> None:
    ms = metaserver_factory(private_redis.url)
    async with httpx.AsyncClient(base_url=ms.url, timeout=30) as http:
        assert (
            await http.put("/v1/instances/decode-0", json=instance_json(ttl_s=300))
        ).status_code == 201
        for i in range(20):
            assert (await http.put(f"/v1/bindings/acked{i}", json=spec_json())).status_code == 201
        assert (
            await http.post("/v1/bindings/acked0/events", json={"state": "done", "actor": "p"})
        ).status_code == 200

        assert private_redis.proc is not None
        private_redis.proc.stop(signal.SIGKILL)  # a crash, not a clean shutdown
        started = time.monotonic()
        r = await http.get("/v1/bindings/acked1")
        assert r.status_code == 503
        assert "redis unreachable" in r.json()["detail"]
        assert r.headers["retry-after"] == "1"
        assert time.monotonic() - started < 10
        assert (await http.put("/v1/bindings/new", json=spec_json())).status_code == 503
        assert (await http.get("/ready")).status_code == 503
        assert (await http.get("/health")).status_code == 200

        private_redis.start()  # same port, same append-only file
        deadline = time.monotonic() + 20
        while (await http.get("/ready")).status_code != 200:
            assert time.monotonic() < deadline, "metaserver did not recover"
            await asyncio.sleep(0.2)
        for i in range(20):
            r = await http.get(f"/v1/bindings/acked{i}")
            assert r.status_code == 200, f"acknowledged binding acked{i} lost"
        assert (await http.get("/v1/bindings/acked0")).json()["state"] == "done"
        # writes and cross-request long-polls work again (the change subscription reconnected)
        waiter = asyncio.create_task(http.get("/v1/bindings/after", params={"wait": 20}))
        await asyncio.sleep(0.5)
        assert (await http.put("/v1/bindings/after", json=spec_json())).status_code == 201
        assert (await asyncio.wait_for(waiter, 10)).status_code == 200
        metrics = (await http.get("/metrics")).text
        line = next(
            x
            for x in metrics.splitlines()
            if x.startswith("pdgate_metaserver_store_unavailable_total")
        )
        assert float(line.split()[1]) >= 3


@pytest.fixture
def sentinel_group(tmp_path: Path) -> Iterator[RedisSentinelGroup]:
    group = RedisSentinelGroup(tmp_path / "sentinel")  # its own: the test kills its master
    group.start()
    try:
        yield group
    finally:
        group.stop()


def _replicated(port: int, key: str) -> bool:
    import redis

    r = redis.Redis(port=port)
    try:
        return bool(r.exists(key))
    finally:
        r.close()


async def test_sentinel_failover_moves_the_metaserver_to_the_promoted_replica(
    sentinel_group: RedisSentinelGroup, metaserver_factory: Callable[..., MetaserverProcess]
) -> None:
    """--store redis+sentinel://: the master is killed; Sentinel promotes the replica, the
    metaserver finds it by itself (503s meanwhile), a replicated binding is still there, and a
    long-poll that spanned the failover is woken by a write made after it."""
    ms = metaserver_factory(sentinel_group.url)
    async with httpx.AsyncClient(base_url=ms.url, timeout=30) as http:
        assert (
            await http.put("/v1/instances/decode-0", json=instance_json(ttl_s=300))
        ).status_code == 201
        assert (await http.put("/v1/bindings/before", json=spec_json())).status_code == 201
        deadline = time.monotonic() + 10
        while not _replicated(sentinel_group.replica.port, "pdgate:b:before"):
            assert time.monotonic() < deadline, "the replica never got the binding"
            await asyncio.sleep(0.05)
        waiter = asyncio.create_task(http.get("/v1/bindings/after", params={"wait": 60}))
        await asyncio.sleep(0.3)
        assert sentinel_group.master.proc is not None
        sentinel_group.master.proc.stop(signal.SIGKILL)
        killed = time.monotonic()
        statuses: list[int] = []
        while True:
            r = await http.put("/v1/bindings/after", json=spec_json(request_id="after"))
            statuses.append(r.status_code)
            if r.status_code == 201:
                break
            assert r.status_code == 503, r.text
            assert time.monotonic() - killed < 30, f"no failover in 30 s: {statuses[-5:]}"
            await asyncio.sleep(0.2)
        took = time.monotonic() - killed
        assert sentinel_group.master_port() == sentinel_group.replica.port
        before = await http.get("/v1/bindings/before")
        assert before.status_code == 200, before.text
        got = await asyncio.wait_for(waiter, 30)
        assert got.status_code == 200 and got.json()["transfer_id"] == "after"
        print(f"failover: writes back {took:.1f}s after the kill, {len(statuses) - 1} 503s")


async def test_workers_share_one_port_and_wake_each_others_long_polls(
    redis_server: RedisServer, metaserver_factory: Callable[..., MetaserverProcess]
) -> None:
    """``--workers 3``: three processes answer on one port over one Redis; a long-poll is woken
    by a write whichever process each of the two connections landed on (a new connection per
    request, so the kernel spreads them)."""
    ns = ("--namespace", f"wk{time.monotonic_ns()}")
    # three processes importing the app at once on two busy cores: give them time to start
    ms = metaserver_factory(redis_server.url, *ns, "--workers", "3", ready_timeout_s=120)
    async with httpx.AsyncClient(
        timeout=30, limits=httpx.Limits(max_keepalive_connections=0)
    ) as http:
        assert (
            await http.put(f"{ms.url}/v1/instances/decode-0", json=instance_json())
        ).status_code == 201
        for i in range(6):  # a new connection each time: the kernel spreads them
            tid = f"w{i}"
            waiter = asyncio.create_task(
                http.get(f"{ms.url}/v1/bindings/{tid}", params={"wait": 20})
            )
            await asyncio.sleep(0.2)
            assert not waiter.done()
            assert (
                await http.put(f"{ms.url}/v1/bindings/{tid}", json=spec_json())
            ).status_code == 201
            got = await asyncio.wait_for(waiter, 10)
            assert got.status_code == 200 and got.json()["transfer_id"] == tid
    log = ms.proc.log_path.read_text() if ms.proc.log_path else ""
    assert "3 process(es)" in log


def test_workers_refuse_the_memory_store() -> None:
    proc = subprocess.run(
        [str(VENV_BIN / "pd-metaserver"), "--workers", "2"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2
    assert "--workers needs a shared store" in proc.stderr and "Traceback" not in proc.stderr
