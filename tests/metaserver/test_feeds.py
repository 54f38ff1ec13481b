"""Binding feeds (``GET /v1/feeds/bindings``) on real pd-metaserver processes: a binding written
through one replica streams out of another's feed as ``GET`` answers it; other prefixes stay
out; one feed may name several prefixes; keepalives flow; a Redis restart ends the feed with
``lost``; bad queries get 422."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import AsyncIterator, Callable, Sequence

import httpx
import pytest

from metaserver.bindings.feeds import Feed
from pdwire.feed import LIVE_LINE, Signal, feed_url, parse_line
from tests.metaserver.test_api import instance_json, spec_json
from tests.support.services import MetaserverProcess, RedisServer


class Reader:
    """The lines of one open feed, as they arrive."""

    def __init__(self, response: httpx.Response) -> None:
        self.lines: asyncio.Queue[bytes] = asyncio.Queue()
        self._response = response
        self._task = asyncio.create_task(self._pump())

    async def _pump(self) -> None:
        async for line in self._response.aiter_lines():
            await self.lines.put(line.encode())
        await self.lines.put(b"<end>")

    async def next(self, timeout_s: float = 5.0, skip_keepalive: bool = True) -> bytes:
        while True:
            line = await asyncio.wait_for(self.lines.get(), timeout_s)
            if not (skip_keepalive and line == b'{"feed":"keepalive"}'):
                return line

    def close(self) -> None:
        self._task.cancel()


@contextlib.asynccontextmanager
async def feed(
    http: httpx.AsyncClient, base: str, prefix: str | Sequence[str], **q: float
) -> AsyncIterator[Reader]:
    async with http.stream("GET", feed_url(base, prefix, **q)) as r:
        assert r.status_code == 200, await r.aread()
        assert r.headers["content-type"].startswith("application/x-ndjson")
        reader = Reader(r)
        try:
            assert await reader.next() == LIVE_LINE.strip()
            yield reader
        finally:
            reader.close()


async def test_feed_streams_bindings_written_through_another_replica(
    redis_server: RedisServer, metaserver_factory: Callable[..., MetaserverProcess]
) -> None:
    ns = ("--namespace", f"feed{time.monotonic_ns()}")
    a = metaserver_factory(redis_server.url, *ns)
    b = metaserver_factory(redis_server.url, *ns)
    async with httpx.AsyncClient(timeout=30) as http:
        assert (await http.put(f"{b.url}/v1/instances/decode-0", json=instance_json())).is_success
        async with feed(http, a.url, "pd-aaaa-", keepalive_s=0.3) as mine:
            started = time.monotonic()
            await http.put(f"{b.url}/v1/bindings/other-1", json=spec_json())  # not my prefix
            assert (
                await http.put(f"{b.url}/v1/bindings/pd-aaaa-1", json=spec_json())
            ).status_code == 201
            line = await mine.next()
            took = time.monotonic() - started
            got = parse_line(line)
            assert got.transfer_id == "pd-aaaa-1" and got.binding is not None
            read = await http.get(f"{a.url}/v1/bindings/pd-aaaa-1")
            assert json.loads(line) == read.json()  # the very record GET answers
            assert took < 2, f"{took:.2f}s from PUT to the feed"
            # events do not re-send it; a second binding comes; keepalives while idle
            await http.post(
                f"{b.url}/v1/bindings/pd-aaaa-1/events", json={"state": "done", "actor": "p"}
            )
            await http.put(f"{a.url}/v1/bindings/pd-aaaa-2", json=spec_json())
            assert parse_line(await mine.next()).transfer_id == "pd-aaaa-2"
            assert await mine.next(skip_keepalive=False) == b'{"feed":"keepalive"}'
        metrics = (await http.get(f"{a.url}/metrics")).text
        assert "pdgate_metaserver_binding_feed_lines_total 2.0" in metrics


async def test_feed_with_the_memory_store_and_two_readers_of_one_prefix(
    metaserver_factory: Callable[..., MetaserverProcess],
) -> None:
    ms = metaserver_factory("memory")
    async with httpx.AsyncClient(timeout=30) as http:
        assert (await http.put(f"{ms.url}/v1/instances/decode-0", json=instance_json())).is_success
        async with feed(http, ms.url, "pd-bbbb-") as one, feed(http, ms.url, "pd-bbbb-") as two:
            await http.put(f"{ms.url}/v1/bindings/pd-bbbb-7", json=spec_json())
            for reader in (one, two):
                assert parse_line(await reader.next()).transfer_id == "pd-bbbb-7"
            gauge = (await http.get(f"{ms.url}/metrics")).text
            assert "pdgate_metaserver_binding_feeds 2.0" in gauge


async def test_feed_of_several_prefixes_sends_each_binding_once(
    metaserver_factory: Callable[..., MetaserverProcess],
) -> None:
    # the ascend-layerwise proxy asks for its own prefix and vllm-ascend's D request ids
    ms = metaserver_factory("memory")
    mine = ("pd-ffff-", "cmpl-pd-ffff-", "chatcmpl-pd-ffff-", "pd-ffff-1")  # the last one nests
    async with httpx.AsyncClient(timeout=30) as http:
        assert (await http.put(f"{ms.url}/v1/instances/decode-0", json=instance_json())).is_success
        async with feed(http, ms.url, mine, keepalive_s=0.3) as reader:
            for tid in ("cmpl-pd-gggg-1-0", "pd-ffff-1", "cmpl-pd-ffff-2-0", "chatcmpl-pd-ffff-3"):
                put = await http.put(f"{ms.url}/v1/bindings/{tid}", json=spec_json())
                assert put.status_code == 201
            got = [parse_line(await reader.next()).transfer_id for _ in range(3)]
            assert got == ["pd-ffff-1", "cmpl-pd-ffff-2-0", "chatcmpl-pd-ffff-3"]
            assert await reader.next(skip_keepalive=False) == b'{"feed":"keepalive"}'
        metrics = (await http.get(f"{ms.url}/metrics")).text
        assert "pdgate_metaserver_binding_feed_lines_total 3.0" in metrics
        # every prefix let go: the server ends the stream after the client closed it
        deadline = time.monotonic() + 5
        while "pdgate_metaserver_binding_feeds 0.0" not in metrics:
            assert time.monotonic() < deadline, "the closed feed is still counted"
            await asyncio.sleep(0.05)
            metrics = (await http.get(f"{ms.url}/metrics")).text


async def test_feed_ends_with_lost_when_redis_goes_away(
    private_redis: RedisServer, metaserver_factory: Callable[..., MetaserverProcess]
) -> None:
    ms = metaserver_factory(private_redis.url, "--namespace", f"lost{time.monotonic_ns()}")
    async with httpx.AsyncClient(timeout=30) as http:
        async with feed(http, ms.url, "pd-cccc-") as reader:
            private_redis.stop()
            assert parse_line(await reader.next(timeout_s=15)).signal is Signal.LOST
            assert await reader.next() == b"<end>"


@pytest.mark.parametrize(
    "query",
    [
        "",
        "prefix=ab",
        "prefix=a%20b%20c%20d",
        "prefix=pd-x-&keepalive=0",
        "prefix=pd-x-&keepalive=61",
        "prefix=pd-x-&prefix=ab",
        "prefix=pd-x-%0A",
        "prefix=pd-1-&prefix=pd-2-&prefix=pd-3-&prefix=pd-4-&prefix=pd-5-",
    ],
)
async def test_feed_bad_query_is_422(
    query: str, metaserver_factory: Callable[..., MetaserverProcess]
) -> None:
    ms = metaserver_factory("memory")
    async with httpx.AsyncClient(timeout=10) as http:
        r = await http.get(f"{ms.url}/v1/feeds/bindings?{query}")
    assert r.status_code == 422, r.text


async def test_feed_needs_the_token_when_reads_are_protected(
    metaserver_factory: Callable[..., MetaserverProcess],
) -> None:
    ms = metaserver_factory("memory", "--token", "s3cret", "--protect-reads")
    async with httpx.AsyncClient(timeout=10) as http:
        r = await http.get(feed_url(ms.url, "pd-dddd-"))
        assert r.status_code == 401
        headers = {"authorization": "Bearer s3cret"}
        async with http.stream("GET", feed_url(ms.url, "pd-dddd-"), headers=headers) as ok:
            assert ok.status_code == 200
            assert (await anext(ok.aiter_lines())).encode() == LIVE_LINE.strip()


async def test_feed_of_a_reader_too_slow_ends_lost(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("metaserver.bindings.feeds.MAX_BUFFERED", 3)
    f = Feed(("pd-eeee-",))
    for i in range(3):
        f.push(b"%d\n" % i)
    assert not f.lost
    f.push(b"3\n")  # one too many: the reader will read the rest with long-polls
    assert f.lost
    assert await f.take(1.0) == [b"0\n", b"1\n", b"2\n"]
