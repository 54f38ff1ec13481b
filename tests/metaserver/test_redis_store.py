"""``RedisStore.close`` ends however soon after ``start`` it comes: its change listener may be
in the middle of subscribing, where a cancel can be lost (Python 3.11's ``wait_for`` inside
redis-py)."""

from __future__ import annotations

import asyncio
import random
import time

from metaserver.store.redis import RedisStore, _cancel_until_done
from tests.support.services import RedisServer

CLOSES = 120


async def test_redis_store_closes_at_any_moment_after_start(redis_server: RedisServer) -> None:
    # before the fix 5 of these 120 closes hung (each until wait_for cancelled it again)
    rng = random.Random(7)
    slow = []
    for i in range(CLOSES):
        store = RedisStore(
            str(redis_server.url), namespace=f"close{i}", binding_ttl_s=60.0, retain_s=120.0
        )
        await store.start()
        await asyncio.sleep(rng.choice((0.0, 0.001, 0.003, 0.006, 0.01, 0.03)))
        started = time.monotonic()
        await asyncio.wait_for(store.close(), 10)  # a hang fails here
        if time.monotonic() - started > 1.0:
            slow.append(i)
    assert not slow, f"closes that took over 1 s: {slow}"


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
    started = time.monotonic()
    await asyncio.wait_for(_cancel_until_done(task), 5)
    assert swallowed.is_set() and task.cancelled()
    assert time.monotonic() - started < 2
