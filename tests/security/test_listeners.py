"""Slow senders, stalled readers and connection hogs against the real listeners (issue 29,
item 4): a ``pd-metaserver`` process, whose requests must arrive whole within
``--receipt-timeout``; the proxy's ``--write-timeout``; both ``--max-client-connections``.
Before the listeners' guards (``pdservice.listener``) the metaserver served plain uvicorn: a
request head trickled one byte every 0.1 s was held for as long as the sender liked, and one
address could open any number of connections. Each attack is cut here while an ordinary
request beside it is answered."""

from __future__ import annotations

import asyncio
import json
import socket
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.fakes.control import FakeVLLM
from tests.proxy.conftest import serve_proxy
from tests.support.procs import free_port
from tests.support.services import MetaserverProcess

RECEIPT_S = 1.0
GIVE_UP_S = 20.0  # far above the deadline: only a server that never cuts the sender fails
CAP = 3
STALLED_TOKENS = 200_000  # about 12 MB of events: more than every buffer on the way holds


@pytest.fixture
def metaserver(tmp_path: Path) -> Iterator[MetaserverProcess]:
    ms = MetaserverProcess(
        "memory", "--receipt-timeout", str(RECEIPT_S), "--max-client-connections", str(CAP),
        log_dir=tmp_path,
    )  # fmt: skip
    try:
        yield ms
    finally:
        ms.stop()


def _port(url: str) -> int:
    return int(url.rsplit(":", 1)[1])


async def _answered(url: str) -> None:
    async with httpx.AsyncClient(base_url=url, timeout=10) as c:
        assert (await c.get("/health")).status_code == 200


async def _cut_after(
    writer: asyncio.StreamWriter, reader: asyncio.StreamReader, drip: bytes
) -> float:
    """Send ``drip`` one byte every 0.1 s until the server closes the connection; how long
    that took."""
    loop = asyncio.get_running_loop()
    began = loop.time()
    read = asyncio.ensure_future(reader.read())
    for i in range(int(GIVE_UP_S / 0.1)):
        if read.done():
            break
        try:
            writer.write(drip[i % len(drip) : i % len(drip) + 1])
            await writer.drain()
        except ConnectionError:
            break
        await asyncio.wait([read], timeout=0.1)
    else:
        raise AssertionError("the server kept the trickled request open")
    try:
        assert await read == b""  # cut, not answered
    except ConnectionResetError:  # closed while a byte was on its way
        pass
    return loop.time() - began


async def test_metaserver_cuts_a_request_head_sent_byte_by_byte(
    metaserver: MetaserverProcess,
) -> None:
    reader, writer = await asyncio.open_connection("127.0.0.1", _port(metaserver.url))
    try:
        writer.write(b"GET /v1/bindings HTTP/1.1\r\nhost: x\r\nx-slow: ")
        took = asyncio.ensure_future(_cut_after(writer, reader, b"abcdefgh"))
        await _answered(metaserver.url)  # served meanwhile
        assert await took < RECEIPT_S + 5
    finally:
        writer.close()


async def test_metaserver_cuts_a_body_that_stops(metaserver: MetaserverProcess) -> None:
    """A whole head and a body that never comes: cut too (plain uvicorn waits for it)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", _port(metaserver.url))
    try:
        writer.write(
            b"PUT /v1/bindings/t-1 HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
            b"content-length: 100000\r\n\r\n{"
        )
        took = await _cut_after(writer, reader, b'"a": 1, ')
        assert took < RECEIPT_S + 5
    finally:
        writer.close()


async def _held(port: int, n: int) -> list[asyncio.StreamWriter]:
    """``n`` open, idle-free connections (each has sent part of a request head)."""
    out = []
    for _ in range(n):
        _, w = await asyncio.open_connection("127.0.0.1", port)
        w.write(b"GET /health HTTP/1.1\r\n")
        await w.drain()
        out.append(w)
    return out


async def _refused_at_once(port: int) -> bool:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(b"GET /health HTTP/1.1\r\nhost: x\r\n\r\n")
        await writer.drain()
        got = await asyncio.wait_for(reader.read(), 5)
    except ConnectionResetError:
        return True
    finally:
        writer.close()
    return got == b""


async def test_metaserver_caps_connections_per_client(metaserver: MetaserverProcess) -> None:
    port = _port(metaserver.url)
    held = await _held(port, CAP)
    try:
        assert await _refused_at_once(port)  # the cap reached: closed unanswered
    finally:
        for w in held:
            w.close()
    await asyncio.sleep(0.3)
    await _answered(metaserver.url)  # the held ones gone, the address is served again


async def test_proxy_caps_connections_per_client() -> None:
    proxy = await serve_proxy(
        {"prefill": ["http://127.0.0.1:9"], "decode": ["http://127.0.0.1:9"], "flow": "direct",
         "port": free_port(), "max_client_connections": CAP}
    )  # fmt: skip
    try:
        port = _port(proxy.url)
        held = await _held(port, CAP)
        try:
            assert await _refused_at_once(port)
        finally:
            for w in held:
                w.close()
        await asyncio.sleep(0.3)
        async with httpx.AsyncClient(base_url=proxy.url, timeout=10) as c:
            assert (await c.get("/metrics")).status_code == 200
    finally:
        await proxy.stop()


async def test_proxy_cuts_a_client_that_stops_reading_its_stream(tmp_path: Path) -> None:
    """A client asks for a long stream and reads none of it: once the proxy's send buffer is
    full it waits ``--write-timeout`` (1 s here), then aborts the connection, and D's request
    is dropped. Before ``write_timeout_s`` the proxy stopped reading D and both waited for
    good."""
    decode = FakeVLLM("decode", log_dir=tmp_path)
    proxy = await serve_proxy(
        {"prefill": [decode.url], "decode": [decode.url], "flow": "direct",
         "port": free_port(), "write_timeout_s": 1.0}
    )  # fmt: skip
    try:
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # a reader that stalls soon
        sock.setblocking(False)
        await asyncio.get_running_loop().sock_connect(sock, ("127.0.0.1", _port(proxy.url)))
        reader, writer = await asyncio.open_connection(sock=sock)
        body = json.dumps(
            {"model": "fake-model", "prompt": "x", "max_tokens": STALLED_TOKENS, "stream": True}
        ).encode()
        writer.write(
            b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
            b"content-length: %d\r\n\r\n%s" % (len(body), body)
        )
        await writer.drain()
        loop = asyncio.get_running_loop()
        deadline = loop.time() + GIVE_UP_S
        while decode.stats()["cancelled"] < 1:  # the proxy dropped D's leg
            assert loop.time() < deadline, f"the stalled reader is still served: {decode.stats()}"
            await asyncio.sleep(0.2)
        async with httpx.AsyncClient(base_url=proxy.url, timeout=10) as c:  # others served
            r = await c.post("/v1/completions", json={"model": "fake-model", "prompt": "y"})
            assert r.status_code == 200
        writer.close()
    finally:
        await proxy.stop()
        decode.stop()
