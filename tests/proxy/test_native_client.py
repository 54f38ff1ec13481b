"""The native data-path client (``proxy.native``) against real loopback servers: keep-alive
reuse, peers that close connections, chunked and close-delimited bodies, slow bodies, resets,
backpressure, and the ``Backend`` error mapping."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator, Awaitable, Callable

import pytest

from proxy.aiohttp_backend import AiohttpBackend
from proxy.backend import LegError
from proxy.errors import UpstreamError, UpstreamRejected, UpstreamTimeout
from proxy.native import NativeBackend, Pools, Target
from proxy.native import connection as native_connection
from tests.support.procs import free_port

Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


class RawServer:
    """A loopback HTTP server whose every byte the test decides."""

    def __init__(self, handler: Handler) -> None:
        self.handler = handler
        self.connections = 0
        self.requests: list[bytes] = []
        self.port = 0
        self._server: asyncio.Server | None = None
        self._writers: list[asyncio.StreamWriter] = []

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def _on_conn(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        self._writers.append(writer)
        with contextlib.suppress(ConnectionError, asyncio.IncompleteReadError):
            await self.handler(reader, writer)

    async def read_request(self, reader: asyncio.StreamReader) -> bytes:
        head = await reader.readuntil(b"\r\n\r\n")
        length = 0
        for line in head.split(b"\r\n"):
            if line.lower().startswith(b"content-length:"):
                length = int(line.split(b":")[1])
        body = await reader.readexactly(length) if length else b""
        self.requests.append(head + body)
        return body

    async def __aenter__(self) -> RawServer:
        self._server = await asyncio.start_server(self._on_conn, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    async def __aexit__(self, *exc: object) -> None:
        for w in self._writers:
            w.close()
        assert self._server is not None
        self._server.close()
        await self._server.wait_closed()


def ok(body: bytes, extra: bytes = b"") -> bytes:
    head = b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n"
    return head + extra + b"content-length: %d\r\n\r\n" % len(body) + body


@pytest.fixture
async def backend() -> AsyncIterator[NativeBackend]:
    import aiohttp

    session = aiohttp.ClientSession()
    fallback = AiohttpBackend(session, connect_timeout_s=1, idle_timeout_s=5, owns_session=True)
    b = NativeBackend(
        Pools(connect_timeout_s=1, keepalive_s=30), idle_timeout_s=5, fallback=fallback
    )
    try:
        yield b
    finally:
        await b.close()


async def _echo_forever(server: RawServer) -> Handler:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while True:
            body = await server.read_request(reader)
            writer.write(ok(b'{"echo":' + (body or b"null") + b"}"))
            await writer.drain()

    return handler


async def test_native_keep_alive_reuses_one_connection(backend: NativeBackend) -> None:
    server = RawServer(lambda r, w: asyncio.sleep(0))
    server.handler = await _echo_forever(server)
    async with server:
        for i in range(5):
            resp = await backend.post(
                server.url, "/v1/completions", b"%d" % i, "rid-1", "decode", 5
            )
            assert resp.status == 200
            assert await resp.read(5) == b'{"echo":%d}' % i
            resp.release()
        assert server.connections == 1
        assert backend.pools.opened == 1
        head = server.requests[0]
        assert head.startswith(b"POST /v1/completions HTTP/1.1\r\n")
        assert b"x-request-id: rid-1\r\n" in head
        assert b"content-length: 1\r\n" in head


async def test_native_peer_closing_idle_connection_costs_no_error(backend: NativeBackend) -> None:
    async def one_then_close(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await server.read_request(reader)
        writer.write(ok(b"{}"))
        await writer.drain()
        writer.close()  # keep-alive answer, then the server drops the idle connection

    server = RawServer(one_then_close)
    async with server:
        for _ in range(3):
            resp = await backend.post(server.url, "/x", b"{}", "r", "decode", 5)
            assert await resp.read(5) == b"{}"
            resp.release()
            await asyncio.sleep(0.05)  # the close reaches the pooled connection
        assert server.connections == 3


async def test_native_connection_close_header_is_not_reused(backend: NativeBackend) -> None:
    async def close_each(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await server.read_request(reader)
        writer.write(ok(b"{}", b"connection: close\r\n"))
        await writer.drain()

    server = RawServer(close_each)
    async with server:
        for _ in range(2):
            resp = await backend.post(server.url, "/x", b"{}", "r", "decode", 5)
            assert await resp.read(5) == b"{}"
            resp.release()
        assert server.connections == 2
        assert backend.pools.idle_count() == 0


async def test_native_chunked_stream_arrives_in_order_then_reuses(backend: NativeBackend) -> None:
    async def chunked(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while True:
            await server.read_request(reader)
            writer.write(
                b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
                b"transfer-encoding: chunked\r\n\r\n"
            )
            for i in range(3):
                event = b"data: %d\n\n" % i
                writer.write(b"%x\r\n%s\r\n" % (len(event), event))
                await writer.drain()
                await asyncio.sleep(0.05)
            writer.write(b"0\r\n\r\n")
            await writer.drain()

    server = RawServer(chunked)
    async with server:
        for _ in range(2):
            resp = await backend.post(server.url, "/s", b"{}", "r", "decode", 5)
            assert resp.content_type == b"text/event-stream"
            got = []
            while chunk := await resp.next_chunk(2):
                got.append(chunk)
            assert b"".join(got) == b"data: 0\n\ndata: 1\n\ndata: 2\n\n"
            assert len(got) == 3  # each event as it came, not buffered up
            resp.release()
        assert server.connections == 1


async def test_native_close_delimited_body_is_complete(backend: NativeBackend) -> None:
    async def unframed(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await server.read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nconnection: close\r\n\r\nall of it")
        await writer.drain()
        writer.close()

    server = RawServer(unframed)
    async with server:
        resp = await backend.post(server.url, "/x", b"{}", "r", "decode", 5)
        assert await resp.read(5) == b"all of it"
        resp.release()
        assert backend.pools.idle_count() == 0


async def test_native_slow_body_times_out(backend: NativeBackend) -> None:
    async def slow(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await server.read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 10\r\n\r\nabc")
        await writer.drain()
        await asyncio.sleep(5)

    server = RawServer(slow)
    async with server:
        resp = await backend.post(server.url, "/x", b"{}", "r", "decode", 5)
        assert await resp.next_chunk(1) == b"abc"
        with pytest.raises(UpstreamTimeout):
            await resp.next_chunk(0.2)
        with pytest.raises(UpstreamTimeout):
            await resp.read(0.2)
        resp.close()


async def test_native_headers_timeout_is_a_retryable_leg_error(backend: NativeBackend) -> None:
    async def silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await server.read_request(reader)
        await asyncio.sleep(5)

    server = RawServer(silent)
    async with server:
        with pytest.raises(LegError) as info:
            await backend.post(server.url, "/x", b"{}", "r", "prefill", 0.2)
        assert isinstance(info.value.cause, UpstreamTimeout)
        assert info.value.retryable and info.value.leg == "prefill"


async def test_native_reset_mid_body_is_an_error(backend: NativeBackend) -> None:
    async def reset(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await server.read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 100\r\n\r\npartial")
        await writer.drain()
        writer.transport.abort()  # RST

    server = RawServer(reset)
    async with server:
        resp = await backend.post(server.url, "/x", b"{}", "r", "decode", 5)
        with pytest.raises(UpstreamError, match="mid-answer"):
            await resp.read(2)
        resp.release()
        assert backend.pools.idle_count() == 0


async def test_native_refused_connection_is_a_retryable_leg_error(
    backend: NativeBackend,
) -> None:
    url = f"http://127.0.0.1:{free_port()}"
    with pytest.raises(LegError) as info:
        await backend.post(url, "/x", b"{}", "r", "decode", 1)
    assert info.value.retryable and info.value.url == url


async def test_native_4xx_goes_back_rebuilt_and_5xx_is_retryable(backend: NativeBackend) -> None:
    said = b'{"error":{"message":"bad","type":"BadRequestError","code":400},"x":"internal"}'
    answers = [b"HTTP/1.1 400 Bad Request\r\ncontent-length: %d\r\n\r\n%s" % (len(said), said),
               b"HTTP/1.1 503 Busy\r\ncontent-length: 4\r\n\r\nbusy"]  # fmt: skip

    async def errors(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        for answer in answers:
            await server.read_request(reader)
            writer.write(answer)
            await writer.drain()
        await asyncio.sleep(1)

    server = RawServer(errors)
    async with server:
        with pytest.raises(LegError) as rejected:
            await backend.post(server.url, "/x", b"{}", "r", "decode", 5)
        assert isinstance(rejected.value.cause, UpstreamRejected)
        assert rejected.value.status == 400 and not rejected.value.retryable
        assert json.loads(rejected.value.body()) == {  # its fields, nothing else it sent
            "error": {"message": "bad", "type": "BadRequestError", "param": None, "code": 400}
        }
        with pytest.raises(LegError) as failed:
            await backend.post(server.url, "/x", b"{}", "r", "decode", 5)
        assert failed.value.retryable and "503" in failed.value.message
        assert server.connections == 1  # error answers with bodies keep the connection


async def test_native_backpressure_pauses_and_keeps_every_byte(
    backend: NativeBackend, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(native_connection, "HIGH_WATER", 4096)
    payload = bytes(range(256)) * 4096  # 1 MiB
    paused: list[int] = []
    real_pause = native_connection.Connection.pause

    def pause(self: native_connection.Connection) -> None:
        paused.append(1)
        real_pause(self)

    monkeypatch.setattr(native_connection.Connection, "pause", pause)

    async def big(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await server.read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n" % len(payload))
        for i in range(0, len(payload), 65536):
            writer.write(payload[i : i + 65536])
            await writer.drain()

    server = RawServer(big)
    async with server:
        resp = await backend.post(server.url, "/x", b"{}", "r", "decode", 5)
        got = bytearray()
        while chunk := await resp.next_chunk(5):
            got += chunk
            await asyncio.sleep(0.002)  # a slow client
        assert bytes(got) == payload
        assert paused  # reading stopped while the client lagged, and resumed
        resp.release()


async def test_native_keepalive_expiry_opens_a_new_connection() -> None:
    import aiohttp

    fallback = AiohttpBackend(aiohttp.ClientSession(), connect_timeout_s=1, idle_timeout_s=5,
                              owns_session=True)  # fmt: skip
    b = NativeBackend(Pools(connect_timeout_s=1, keepalive_s=0.1), idle_timeout_s=5,
                      fallback=fallback)  # fmt: skip
    server = RawServer(lambda r, w: asyncio.sleep(0))
    server.handler = await _echo_forever(server)
    try:
        async with server:
            for _ in range(2):
                resp = await b.post(server.url, "/x", b"1", "r", "decode", 5)
                await resp.read(5)
                resp.release()
                await asyncio.sleep(0.2)
            assert server.connections == 2
    finally:
        await b.close()


async def test_native_get_returns_any_status(backend: NativeBackend) -> None:
    async def notfound(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await server.read_request(reader)
        writer.write(b"HTTP/1.1 404 Not Found\r\ncontent-length: 2\r\n\r\nno")
        await writer.drain()
        await asyncio.sleep(1)

    server = RawServer(notfound)
    async with server:
        status, body = await backend.get(
            server.url + "/v1/bindings/t1?wait=2", {"authorization": "Bearer k"}, 5
        )
        assert (status, body) == (404, b"no")
        head = server.requests[0]
        assert head.startswith(b"GET /v1/bindings/t1?wait=2 HTTP/1.1\r\n")
        assert b"authorization: Bearer k\r\n" in head


def test_native_target_rejects_https_and_builds_head() -> None:
    t = Target("http://10.0.0.1:8100", "/v1/chat/completions")
    assert t.key == ("10.0.0.1", 8100)
    assert t.head == b"POST /v1/chat/completions HTTP/1.1\r\nhost: 10.0.0.1:8100\r\n"
    with pytest.raises(ValueError):
        Target("https://example.com", "/x")
