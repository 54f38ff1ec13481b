"""The proxy's binding feed against a real pd-metaserver on a real Redis: a waiting request gets
D's binding from the feed (no long-poll); when the feed is lost mid-wait the request reads the
binding with a long-poll instead, and the feed comes back by itself; an older metaserver
without feeds leaves every read to long-polls."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable

import aiohttp
import msgspec
import pytest
import redis.asyncio as aioredis

from proxy.aiohttp_backend import AiohttpBackend
from proxy.flows.bindings import BindingMissing, BindingSource
from proxy.flows.feed import BindingFeed
from proxy.metrics import Metrics
from tests.metaserver.test_api import instance_json, spec_json
from tests.support.services import MetaserverProcess, RedisServer

PREFIX = "pd-feedtest0001-"


class Wired:
    def __init__(self, session: aiohttp.ClientSession, url: str) -> None:
        self.metrics = Metrics(list)
        backend = AiohttpBackend(session, connect_timeout_s=5, idle_timeout_s=30)
        self.source = BindingSource(backend, url, None, self.metrics)
        self.feed = BindingFeed(session, url, None, (PREFIX,), keepalive_s=0.5)
        self.source.feed = self.feed

    def reads(self) -> tuple[float, float]:
        m = self.metrics
        return m.binding_reads_feed.value, m.binding_reads_long_poll.value

    async def until_live(self, timeout_s: float = 10) -> None:
        deadline = time.monotonic() + timeout_s
        while not self.feed.live:
            assert time.monotonic() < deadline, "the feed never went live"
            await asyncio.sleep(0.02)


@pytest.fixture
async def session() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession() as s:
        yield s


async def _put(session: aiohttp.ClientSession, url: str, tid: str) -> None:
    async with session.put(f"{url}/v1/bindings/{tid}", json=spec_json()) as r:
        assert r.status == 201, await r.text()


async def _registered(session: aiohttp.ClientSession, url: str) -> None:
    async with session.put(f"{url}/v1/instances/decode-0", json=instance_json()) as r:
        assert r.status in (200, 201)


async def test_binding_feed_serves_the_wait_without_a_long_poll(
    redis_server: RedisServer,
    metaserver_factory: Callable[..., MetaserverProcess],
    session: aiohttp.ClientSession,
) -> None:
    ns = ("--namespace", f"pf{time.monotonic_ns()}")
    a = metaserver_factory(redis_server.url, *ns)
    b = metaserver_factory(redis_server.url, *ns)  # D writes through another replica
    await _registered(session, b.url)
    w = Wired(session, a.url)
    runner = asyncio.create_task(w.feed.run())
    try:
        await w.until_live()
        waiting = asyncio.create_task(w.source.wait(PREFIX + "1", 10))
        await asyncio.sleep(0.2)
        assert not waiting.done()
        await _put(session, b.url, PREFIX + "1")
        raw = await asyncio.wait_for(waiting, 5)
        assert msgspec.json.decode(raw)["transfer_id"] == PREFIX + "1"
        assert w.reads() == (1, 0)
        # an id of another process (another prefix) is read with a long-poll
        await _put(session, b.url, "pd-elsewhere00-1")
        assert msgspec.json.decode(await w.source.wait("pd-elsewhere00-1", 5))["state"] == "bound"
        assert w.reads() == (1, 1)
    finally:
        runner.cancel()
        await asyncio.gather(runner, return_exceptions=True)


async def test_binding_feed_lost_mid_wait_falls_back_to_a_long_poll_and_comes_back(
    redis_server: RedisServer,
    metaserver_factory: Callable[..., MetaserverProcess],
    session: aiohttp.ClientSession,
) -> None:
    ms = metaserver_factory(redis_server.url, "--namespace", f"pl{time.monotonic_ns()}")
    await _registered(session, ms.url)
    w = Wired(session, ms.url)
    runner = asyncio.create_task(w.feed.run())
    r = aioredis.from_url(redis_server.url)
    try:
        await w.until_live()
        waiting = asyncio.create_task(w.source.wait(PREFIX + "2", 20))
        await asyncio.sleep(0.2)
        # Redis drops the metaserver's subscription: its feeds end with "lost"
        assert await r.client_kill_filter(_type="pubsub") >= 1
        deadline = time.monotonic() + 10
        while w.feed.live:
            assert time.monotonic() < deadline, "the feed never noticed"
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.2)
        assert not waiting.done()  # now a long-poll waits
        await _put(session, ms.url, PREFIX + "2")
        raw = await asyncio.wait_for(waiting, 5)
        assert msgspec.json.decode(raw)["transfer_id"] == PREFIX + "2"
        assert w.reads() == (0, 1)
        await w.until_live()  # reopened by itself
        waiting = asyncio.create_task(w.source.wait(PREFIX + "3", 10))
        await asyncio.sleep(0.1)
        await _put(session, ms.url, PREFIX + "3")
        await asyncio.wait_for(waiting, 5)
        assert w.reads() == (1, 1)
    finally:
        await r.aclose()
        runner.cancel()
        await asyncio.gather(runner, return_exceptions=True)


async def test_binding_feed_absent_leaves_reads_to_long_polls(
    aiohttp_404: str, session: aiohttp.ClientSession, caplog: pytest.LogCaptureFixture
) -> None:
    w = Wired(session, aiohttp_404)
    runner = asyncio.create_task(w.feed.run())
    try:
        deadline = time.monotonic() + 5
        while "binding feed refused (404" not in caplog.text:
            assert time.monotonic() < deadline, caplog.text
            await asyncio.sleep(0.02)
        assert not w.feed.live
        with pytest.raises(BindingMissing):
            await w.source.wait(PREFIX + "4", 0.2)
        assert w.reads() == (0, 1)
    finally:
        runner.cancel()
        await asyncio.gather(runner, return_exceptions=True)


@pytest.fixture
async def aiohttp_404() -> AsyncIterator[str]:
    """A server that knows no binding and no feed (404 for everything), like a metaserver of
    a release before feeds asked for a binding D never wrote."""
    from aiohttp import web

    app = web.Application()
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        await runner.cleanup()
