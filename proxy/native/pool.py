"""Keep-alive connection pools, one per backend origin, and the request writer.

A request goes on an idle pooled connection when one is alive (the peer may have closed it
while it idled: such connections are dropped before anything is written, so that case never
costs a retry), else on a new one (``connect_timeout_s``). Requests are written in one
``transport.write`` from a head prebuilt per (origin, path).
"""

from __future__ import annotations

import asyncio
import socket
import weakref
from urllib.parse import urlsplit

from proxy.errors import UpstreamError, UpstreamTimeout
from proxy.native.connection import Connection, NativeResponse


class Target:
    """An origin and path, parsed once: the request head up to the per-request headers."""

    __slots__ = ("head", "host", "key", "port")

    def __init__(self, url: str, path: str, method: str = "POST") -> None:
        parts = urlsplit(url + path)
        if parts.scheme != "http" or not parts.hostname:
            raise ValueError(f"the native client speaks plain http only, not {url!r}")
        self.host = parts.hostname
        self.port = parts.port or 80
        self.key = (self.host, self.port)
        target = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
        netloc = parts.netloc.rpartition("@")[2]
        self.head = f"{method} {target} HTTP/1.1\r\nhost: {netloc}\r\n".encode("latin-1")


class Pools:
    def __init__(
        self,
        *,
        connect_timeout_s: float,
        keepalive_s: float = 30.0,
        max_idle_per_origin: int = 1024,
    ) -> None:
        self._connect_timeout = connect_timeout_s
        self._keepalive = keepalive_s
        self._max_idle = max_idle_per_origin
        self._idle: dict[tuple[str, int], list[Connection]] = {}
        self._all: weakref.WeakSet[Connection] = weakref.WeakSet()
        self._loop: asyncio.AbstractEventLoop | None = None
        self.opened = 0  # connections ever opened (tests, stats)

    async def _acquire(self, target: Target) -> Connection:
        loop = self._loop
        if loop is None:
            loop = self._loop = asyncio.get_running_loop()
        idle = self._idle.get(target.key)
        if idle:
            now = loop.time()
            while idle:
                conn = idle.pop()
                if conn.closed or now - conn.idle_since > self._keepalive:
                    conn.close()
                    self._all.discard(conn)
                    continue
                return conn
        key = target.key

        def on_idle(c: Connection) -> None:
            self._put(key, c)

        try:
            async with asyncio.timeout(self._connect_timeout):
                _, conn = await loop.create_connection(
                    lambda: Connection(loop, on_idle), target.host, target.port
                )
        except TimeoutError as exc:
            raise UpstreamTimeout(f"connect timed out after {self._connect_timeout}s") from exc
        except OSError as exc:
            raise UpstreamError(f"connection failed: {exc!r}") from exc
        sock = conn.transport.get_extra_info("socket") if conn.transport else None
        if sock is not None:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.opened += 1
        self._all.add(conn)
        return conn

    def _put(self, key: tuple[str, int], conn: Connection) -> None:
        idle = self._idle.setdefault(key, [])
        if len(idle) >= self._max_idle or conn.closed:
            conn.close()
            self._all.discard(conn)
            return
        assert self._loop is not None
        conn.idle_since = self._loop.time()
        idle.append(conn)

    async def send(
        self, target: Target, headers: bytes, body: bytes, idle_s: float
    ) -> NativeResponse:
        """Write one request (``headers``: extra ``name: value\\r\\n`` lines) and return its
        answer, headers not yet waited for."""
        conn = await self._acquire(target)
        if body:
            data = b"%s%scontent-length: %d\r\n\r\n%s" % (target.head, headers, len(body), body)
        else:
            data = target.head + headers + b"\r\n"
        return conn.send(data, idle_s)

    def idle_count(self) -> int:
        return sum(len(v) for v in self._idle.values())

    def close(self) -> None:
        for conn in list(self._all):
            conn.close()
        self._all.clear()
        self._idle.clear()
