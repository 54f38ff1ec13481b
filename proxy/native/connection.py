"""One keep-alive HTTP/1.1 connection (``asyncio.Protocol`` + ``httptools``) and the answer
being read on it.

The parser's callbacks feed a ``NativeResponse``: headers wake the sender, body chunks queue
up until the reader takes them (reading pauses above ``HIGH_WATER`` buffered bytes and resumes
once the reader caught up), the end of the message makes the connection reusable when the
server keeps it alive. Waiting is one future per wait plus one timer handle, and only when the
bytes are not already there.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any, cast

import httptools

from proxy.errors import UpstreamError, UpstreamTimeout

HIGH_WATER = 256 * 1024


def _expire(fut: asyncio.Future[bool]) -> None:
    if not fut.done():
        fut.set_result(False)


class NativeResponse:
    __slots__ = (
        "_chunks",
        "_conn",
        "_loop",
        "_size",
        "_waiter",
        "content_type",
        "done",
        "error",
        "framed",
        "headers_done",
        "idle_s",
        "keep_alive",
        "status",
    )

    def __init__(self, conn: Connection, idle_s: float) -> None:
        self._conn = conn
        self._loop = conn.loop
        self._chunks: list[bytes] = []
        self._size = 0
        self._waiter: asyncio.Future[bool] | None = None
        self.idle_s = idle_s
        self.status = 0
        self.content_type = b"application/json"
        self.headers_done = False
        self.done = False
        self.keep_alive = False
        self.framed = False  # content-length or chunked: the end is known without EOF
        self.error: UpstreamError | None = None

    # ---- fed by the connection ------------------------------------------------------------
    def _wake(self) -> None:
        w = self._waiter
        if w is not None and not w.done():
            w.set_result(True)

    def _feed(self, data: bytes) -> None:
        self._chunks.append(data)
        self._size += len(data)
        if self._size > HIGH_WATER:
            self._conn.pause()
        self._wake()

    def _fail(self, error: UpstreamError) -> None:
        if not self.done and self.error is None:
            self.error = error
        self._wake()

    # ---- read by the proxy ----------------------------------------------------------------
    async def wait(self, timeout_s: float | None, what: str) -> None:
        """Wait for the connection to report anything (headers, body, end, error)."""
        fut: asyncio.Future[bool] = self._loop.create_future()
        self._waiter = fut
        timer = None
        if timeout_s is not None:
            timer = self._loop.call_later(max(timeout_s, 0.0), _expire, fut)
        try:
            arrived = await fut
        finally:
            self._waiter = None
            if timer is not None:
                timer.cancel()
        if not arrived:
            raise UpstreamTimeout(f"no {what} in {timeout_s}s")

    async def next_chunk(self, timeout_s: float | None = None) -> bytes:
        while True:
            chunks = self._chunks
            if chunks:
                data = chunks[0] if len(chunks) == 1 else b"".join(chunks)
                self._chunks = []
                if self._size > HIGH_WATER:
                    self._conn.resume()
                self._size = 0
                return data
            if self.error is not None:
                raise self.error
            if self.done:
                return b""
            await self.wait(self.idle_s if timeout_s is None else timeout_s, "data")

    async def read(self, timeout_s: float) -> bytes:
        if self.done and self.error is None:  # the common case: all in with the headers
            chunks = self._chunks
            self._chunks = []
            self._size = 0
            return chunks[0] if len(chunks) == 1 else b"".join(chunks)
        deadline = self._loop.time() + timeout_s
        parts: list[bytes] = []
        while True:
            left = deadline - self._loop.time()
            if left <= 0:
                raise UpstreamTimeout(f"no complete answer in {timeout_s}s")
            data = await self.next_chunk(left)
            if not data:
                return b"".join(parts)
            parts.append(data)

    @property
    def complete(self) -> bool:
        return self.done and self.error is None

    def release(self) -> None:
        conn = self._conn
        if conn.response is not self:
            return  # already released or closed
        if self.done and self.error is None and self.keep_alive and not conn.closed:
            conn.response = None
            conn.on_idle(conn)
        else:
            conn.close()

    def close(self) -> None:
        if self._conn.response is self:
            self._conn.close()


class Connection(asyncio.Protocol):
    """Carries one request at a time; ``on_idle`` hands it back to its pool."""

    def __init__(self, loop: asyncio.AbstractEventLoop, on_idle: Callable[[Connection], Any]):
        self.loop = loop
        self.on_idle = on_idle
        self.transport: asyncio.Transport | None = None
        self.response: NativeResponse | None = None
        self.closed = False
        self.idle_since = 0.0
        self._paused = False
        self._parser = httptools.HttpResponseParser(self)

    # ---- asyncio.Protocol -----------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's is not a subclass

    def data_received(self, data: bytes) -> None:
        resp = self.response
        if resp is None:  # bytes nobody asked for: the connection cannot be trusted
            self.close()
            return
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserError as exc:
            resp._fail(UpstreamError(f"malformed HTTP answer: {exc}"))
            self.close()

    def eof_received(self) -> bool | None:
        return None  # close our side too; connection_lost follows

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        resp = self.response
        if resp is not None and not resp.done:
            if resp.headers_done and not resp.framed:
                resp.done = True  # an answer delimited by the connection's end
                resp._wake()
            else:
                what = "before the answer" if not resp.headers_done else "mid-answer"
                resp._fail(UpstreamError(f"connection closed {what}: {exc or 'EOF'}"))

    # ---- httptools callbacks --------------------------------------------------------------
    def on_header(self, name: bytes, value: bytes) -> None:
        resp = self.response
        assert resp is not None
        lname = name.lower()
        if lname == b"content-type":
            resp.content_type = value
        elif lname == b"content-length" or (
            lname == b"transfer-encoding" and b"chunked" in value.lower()
        ):
            resp.framed = True

    def on_headers_complete(self) -> None:
        resp = self.response
        assert resp is not None
        resp.status = self._parser.get_status_code()
        resp.keep_alive = self._parser.should_keep_alive()
        resp.headers_done = True
        resp._wake()

    def on_body(self, body: bytes) -> None:
        resp = self.response
        assert resp is not None
        resp._feed(body)

    def on_message_complete(self) -> None:
        resp = self.response
        assert resp is not None
        resp.done = True
        resp._wake()

    # ---- used by the pool -----------------------------------------------------------------
    def send(self, data: bytes, idle_s: float) -> NativeResponse:
        assert self.transport is not None
        resp = self.response = NativeResponse(self, idle_s)
        self.transport.write(data)
        return resp

    def pause(self) -> None:
        if not self._paused and self.transport is not None:
            self._paused = True
            self.transport.pause_reading()

    def resume(self) -> None:
        if self._paused and self.transport is not None and not self.closed:
            self._paused = False
            self.transport.resume_reading()

    def close(self) -> None:
        self.closed = True
        if self.transport is not None:
            self.transport.close()
        resp = self.response
        if resp is not None and not resp.done:
            resp._fail(UpstreamError("connection closed by the proxy"))
