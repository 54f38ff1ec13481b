"""``PUT`` and ``GET /v1/load/{replica}``: proxy replicas' load summed across them, lapsing
with its TTL, on every store (Redis: one board for every metaserver replica)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import redis.asyncio as aioredis

from metaserver.store.redis_pool import close_pool, make_pool
from tests.metaserver.conftest import SHORT_TTL_S, StoreTime

LAPSE_S = SHORT_TTL_S + 0.2  # a's report lapses (on Redis: real time, Redis's own expiry)


async def test_replicas_see_the_others_sum(
    api_factory: Callable[..., Any], store_time: StoreTime
) -> None:
    api = await api_factory()
    a = {"instances": {"http://p0": [2, 500], "http://p1": [1, 10]}, "ttl_s": SHORT_TTL_S}
    r = await api.put("/v1/load/a", json=a)
    assert r.status_code == 200
    assert r.json() == {"others": {}, "open_circuits": [], "recent": {}, "replicas": 1}
    b = {
        "instances": {"http://p0": [1, 100]},
        "open_circuits": ["http://p1"],
        "recent": {"http://p0": 700, "http://p1": 5},
        "ttl_s": 30,
    }
    r = await api.put("/v1/load/b", json=b)
    assert r.json()["others"] == {"http://p0": [2, 500], "http://p1": [1, 10]}
    c = {"instances": {}, "recent": {"http://p0": 300}, "ttl_s": 30}
    r = await api.put("/v1/load/c", json=c)
    assert r.json() == {
        "others": {"http://p0": [3, 600], "http://p1": [1, 10]},
        "open_circuits": ["http://p1"],
        "recent": {"http://p0": 700, "http://p1": 5},
        "replicas": 3,
    }
    r = await api.put("/v1/load/a", json=a)  # each replica's recent work, summed
    assert r.json()["recent"] == {"http://p0": 1000, "http://p1": 5}
    await store_time.lapse(LAPSE_S)  # a's report lapses
    r = await api.put("/v1/load/c", json={"instances": {}, "ttl_s": 30})
    assert r.json()["others"] == {"http://p0": [1, 100]} and r.json()["replicas"] == 2


async def test_bad_reports_are_422(api_factory: Callable[..., Any]) -> None:
    api = await api_factory()
    for body in (
        {"instances": {"http://p0": [-1, 0]}},
        {"instances": {"http://p0": [1]}},
        {"instances": {}, "ttl_s": 0},
        {"instances": {}, "extra": 1},
        {"instances": {}, "recent": {"http://p0": -5}},
    ):
        assert (await api.put("/v1/load/a", json=body)).status_code == 422, body
    assert (await api.put("/v1/load/bad%20id", json={"instances": {}})).status_code == 422


async def test_a_read_sees_the_others_and_writes_nothing(
    api_factory: Callable[..., Any], store_kind: str, store_url: str, store_time: StoreTime
) -> None:
    """``GET /v1/load/{replica}``: what a proxy reads before each choice. It counts no report
    for the reader, and on Redis writes nothing (a write waits for the disk there)."""
    api = await api_factory()
    a = {"instances": {"http://p0": [2, 500]}, "ttl_s": SHORT_TTL_S}
    await api.put("/v1/load/a", json=a)
    await api.put("/v1/load/b", json={"instances": {"http://p0": [1, 100]}, "ttl_s": 30})
    dirty = await redis_writes(store_url) if store_kind != "memory" else 0
    r = await api.get("/v1/load/c")
    assert r.status_code == 200
    assert r.json() == {
        "others": {"http://p0": [3, 600]},
        "open_circuits": [],
        "recent": {},
        "replicas": 2,
    }
    assert (await api.get("/v1/load/b")).json()["others"] == {"http://p0": [2, 500]}
    await store_time.lapse(LAPSE_S)  # a's report lapses; the reads counted none for c
    r = await api.get("/v1/load/c")
    assert r.json()["others"] == {"http://p0": [1, 100]} and r.json()["replicas"] == 1
    if store_kind != "memory":
        assert await redis_writes(store_url) == dirty
    assert (await api.get("/v1/load/bad%20id")).status_code == 422


async def redis_writes(url: str) -> int:
    """Redis's count of writes since its last save (``rdb_changes_since_last_save``)."""
    pool = make_pool(url)
    r = aioredis.Redis(connection_pool=pool)
    try:
        info = await r.info("persistence")
    finally:
        await r.aclose()
        await close_pool(pool)
    return int(info["rdb_changes_since_last_save"])
