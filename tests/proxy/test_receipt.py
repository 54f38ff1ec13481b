"""Slow senders (slowloris) against pd-proxy's real uvicorn server: a request head sent byte by
byte, a body that stops, a connection that sends nothing. Each is cut off by its receipt
deadline, and while they hang on, ordinary requests are answered — none of them takes an
admission slot before its body is in (``--max-inflight 1`` here)."""

from __future__ import annotations

import asyncio
import json

import httpx

from tests.proxy.conftest import Cluster, ProxyFactory
from tests.proxy.test_flows import PROMPT

RECEIPT_S = 1.0
GIVE_UP_S = 20.0  # far above the deadline: only a server that never cuts the sender fails


def _port(url: str) -> int:
    return int(url.rsplit(":", 1)[1])


async def _answered(url: str) -> None:
    async with httpx.AsyncClient(base_url=url, timeout=10) as c:
        r = await c.post("/v1/completions", json={"model": "fake-model", "prompt": PROMPT})
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"]


async def _trickle_until_closed(
    writer: asyncio.StreamWriter, reader: asyncio.StreamReader
) -> bytes:
    """Send one header byte every 0.1 s until the server closes the connection; what it sent
    back (nothing, for a cut head). A close that overtakes a byte in flight reaches us as a
    reset (a run in the full suite), which is the same cut."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + GIVE_UP_S
    read = asyncio.ensure_future(reader.read())
    while not read.done():
        assert loop.time() < deadline, "the proxy kept a trickled request head open"
        try:
            writer.write(b"x")
            await writer.drain()
        except ConnectionError:
            break
        await asyncio.wait([read], timeout=0.1)
    try:
        return await read
    except ConnectionResetError:  # closed while our next byte was on its way: the peer's RST
        return b""


async def test_receipt_request_head_sent_byte_by_byte_is_cut_off(
    cluster: Cluster, proxy_factory: ProxyFactory
) -> None:
    proxy = await proxy_factory(flow="direct", receipt_timeout_s=RECEIPT_S, max_inflight=1)
    reader, writer = await asyncio.open_connection("127.0.0.1", _port(proxy.url))
    try:
        writer.write(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\nx-slow: ")
        trickle = asyncio.ensure_future(_trickle_until_closed(writer, reader))
        await _answered(proxy.url)  # the slow head does not stop anyone else
        assert await trickle == b""
    finally:
        writer.close()


async def test_receipt_body_that_stops_gets_408_and_holds_no_admission_slot(
    cluster: Cluster, proxy_factory: ProxyFactory
) -> None:
    proxy = await proxy_factory(flow="direct", receipt_timeout_s=RECEIPT_S, max_inflight=1)
    body = json.dumps({"model": "fake-model", "prompt": PROMPT}).encode()
    reader, writer = await asyncio.open_connection("127.0.0.1", _port(proxy.url))
    try:
        writer.write(
            b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
            b"content-length: %d\r\n\r\n" % len(body) + body[:10]
        )
        await writer.drain()
        # the only admission slot is free while that body is missing
        await _answered(proxy.url)
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), GIVE_UP_S)
        assert head.startswith(b"HTTP/1.1 408"), head
        assert b"connection: close" in head.lower()
        length = int(head.lower().split(b"content-length: ")[1].split(b"\r\n")[0])
        error = json.loads(await reader.readexactly(length))["error"]
        assert error["type"] == "invalid_request_error"
        assert "not received within 1s" in error["message"]
        assert await asyncio.wait_for(reader.read(), GIVE_UP_S) == b""  # and it is closed
    finally:
        writer.close()
    await _answered(proxy.url)  # the slot it never took is still free


async def test_receipt_connection_that_sends_nothing_is_closed(
    cluster: Cluster, proxy_factory: ProxyFactory
) -> None:
    proxy = await proxy_factory(flow="direct", client_keepalive_s=RECEIPT_S)
    reader, writer = await asyncio.open_connection("127.0.0.1", _port(proxy.url))
    try:
        assert await asyncio.wait_for(reader.read(), GIVE_UP_S) == b""
    finally:
        writer.close()


async def test_receipt_a_whole_request_is_unaffected(
    cluster: Cluster, proxy_factory: ProxyFactory
) -> None:
    """A keep-alive connection that waits longer than the deadline between requests is
    served again: the deadline runs from a request's first byte, not from the last answer."""
    proxy = await proxy_factory(flow="direct", receipt_timeout_s=RECEIPT_S)
    async with httpx.AsyncClient(base_url=proxy.url, timeout=10) as c:
        for _ in range(2):
            r = await c.post("/v1/completions", json={"model": "fake-model", "prompt": PROMPT})
            assert r.status_code == 200, r.text
            await asyncio.sleep(2 * RECEIPT_S)
        assert r.json()["choices"][0]["text"]
