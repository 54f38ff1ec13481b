"""``RedisStore.close`` ends however soon after ``start`` it comes: its change listener may be
in the middle of subscribing, where a cancel can be lost (Python 3.11's ``wait_for`` inside
redis-py). The change listener outlives any message published on its channels."""

from __future__ import annotations

import asyncio
import random

import httpx
import redis.asyncio as aioredis

from metaserver.app import create_app
from metaserver.backend import redis_backend
from metaserver.config import MetaserverSettings
from metaserver.store.redis import RedisStore
from metaserver.store.redis_listener import _cancel_until_done
from tests.metaserver.test_api import register, spec_json
from tests.support.clock import virtual_time
from tests.support.services import RedisServer

CLOSES = 120


async def test_redis_store_closes_at_any_moment_after_start(redis_server: RedisServer) -> None:
    # before the fix 5 of these 120 closes hung until something cancelled them: each close
    # here is left alone, and one still running after 10 s (a hang guard, not a time
    # bound: a close takes milliseconds) is a hang
    rng = random.Random(7)
    hung = []
    for i in range(CLOSES):
        store = RedisStore(
            str(redis_server.url), namespace=f"close{i}", binding_ttl_s=60.0, retain_s=120.0
        )
        await store.start()
        await asyncio.sleep(rng.choice((0.0, 0.001, 0.003, 0.006, 0.01, 0.03)))
        closing = asyncio.create_task(store.close())
        await asyncio.wait({closing}, timeout=10)
        if not closing.done():
            hung.append(i)
            closing.cancel()
        else:
            closing.result()
    assert not hung, f"closes that never ended: {hung}"


@virtual_time
async def test_redis_store_cancel_until_done_outlasts_a_swallowed_cancel() -> None:
    swallowed = asyncio.Event()

    async def stubborn() -> None:
        try:
            await asyncio.sleep(30)
        except asyncio.CancelledError:
            swallowed.set()  # as wait_for does when its call completes at the cancel
        await asyncio.sleep(30)

    task = asyncio.create_task(stubborn())
    await asyncio.sleep(0)
    clock = asyncio.get_running_loop().time  # virtual: the 30 s sleeps are timers on it
    started = clock()
    await asyncio.wait_for(_cancel_until_done(task), 5)
    assert swallowed.is_set() and task.cancelled()
    assert clock() - started < 2


async def test_redis_change_listener_outlives_unreadable_messages(
    redis_server: RedisServer,
) -> None:
    # before: a message the listener could not parse (a transfer id ending in a newline broke
    # the "created" message) ended the listener without a word, and from then on every
    # long-poll on a binding written meanwhile waited its whole wait
    backend = redis_backend(
        str(redis_server.url), namespace="garbage", binding_ttl_s=60.0, retain_s=120.0
    )
    store = backend.store
    assert isinstance(store, RedisStore)
    await backend.start()
    app = create_app(MetaserverSettings(), backend=backend)
    raw = aioredis.from_url(str(redis_server.url))
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url="http://ms") as api:
        try:
            await register(api)
            await asyncio.wait_for(store.subscribed.wait(), 10)
            for tid in ("t1", "t2"):
                # a wait far past the test's (capped at max_wait_s: 120 s): only the write
                # ends it within the test
                wait = {"wait": 3600}
                poll = asyncio.ensure_future(api.get(f"/v1/bindings/{tid}", params=wait))
                await asyncio.sleep(0.3)
                for channel in ("garbage:created", "garbage:changes"):
                    await raw.publish(channel, b"\xff\xfe no id\n")
                await asyncio.sleep(0.3)
                assert (await api.put(f"/v1/bindings/{tid}", json=spec_json())).status_code == 201
                r = await asyncio.wait_for(poll, 30)
                assert r.status_code == 200 and r.json()["transfer_id"] == tid
                assert "x-pdgate-wait" not in r.headers  # woken by the write, not the wait's end
            assert store.bad_messages >= 3
        finally:
            await raw.aclose()
            await backend.close()
