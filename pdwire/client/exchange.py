"""How the blocking client moves one request: ``PlainExchange`` (the default) or httpx.

The blocking client runs inside vLLM's engine processes (the scheduler half's binding and event
writes, the worker half's events, heartbeats). Its threads share the GIL with the engine loop,
so every µs of Python they run per call is a µs ``schedule()`` may wait for, and a thread
woken mid-step can hold the GIL for a whole switch interval (5 ms). httpx spends ≈ 410 µs of
CPU per call on loopback; the standard library's ``http.client`` ≈ 115 µs
(``tests/bench/push_bench.py``'s scheduler part shows the effect). ``PlainExchange`` keeps one
keep-alive connection per thread. ``HttpxExchange`` serves a given ``httpx`` transport (tests
with ``httpx.MockTransport``).

Neither reads ``HTTP(S)_PROXY``: the metaserver is reached directly, as the proxy's aiohttp
client does. ``https`` uses the system's trust store (``ssl.create_default_context``, which
honours ``SSL_CERT_FILE`` / ``SSL_CERT_DIR``).
"""

from __future__ import annotations

import http.client
import ssl
import threading
from collections.abc import Callable
from typing import Protocol
from urllib.parse import urlencode, urlsplit

import httpx

Headers = dict[str, str] | Callable[[], dict[str, str]]  # a callable: asked for each request


def headers_of(headers: Headers) -> Callable[[], dict[str, str]]:
    if callable(headers):
        return headers
    fixed = dict(headers)
    return lambda: fixed


class ExchangeError(Exception):
    """The request did not get an answer (connect, reset, timeout): retryable."""


class Exchange(Protocol):
    def request(
        self,
        method: str,
        path: str,
        params: dict[str, str] | None,
        body: bytes | None,
        timeout: float,
    ) -> tuple[int, bytes]:
        """``(status, body)``; raises ``ExchangeError`` when no answer came."""
        ...

    def close(self) -> None: ...


class PlainExchange:
    def __init__(self, base_url: str, headers: Headers) -> None:
        url = urlsplit(base_url)
        if url.scheme not in ("http", "https") or not url.hostname:
            raise ValueError(f"metaserver URL must be http(s)://host[:port], not {base_url!r}")
        self._https = url.scheme == "https"
        self._host = url.hostname
        self._port = url.port or (443 if self._https else 80)
        self._prefix = url.path.rstrip("/")
        self._headers = headers_of(headers)
        self._ssl = ssl.create_default_context() if self._https else None
        self._local = threading.local()
        self._lock = threading.Lock()
        self._open: set[http.client.HTTPConnection] = set()
        self._closed = False

    def _connection(self, timeout: float) -> tuple[http.client.HTTPConnection, bool]:
        """This thread's connection, and whether it served a request before."""
        conn: http.client.HTTPConnection | None = getattr(self._local, "conn", None)
        if conn is not None and conn.sock is not None:
            conn.sock.settimeout(timeout)
            return conn, True
        if self._closed:  # http.client would reconnect a closed one: a socket nobody closes
            raise ExchangeError("client closed")
        if conn is None:
            if self._ssl is not None:
                conn = http.client.HTTPSConnection(
                    self._host, self._port, timeout=timeout, context=self._ssl
                )
            else:
                conn = http.client.HTTPConnection(self._host, self._port, timeout=timeout)
            self._local.conn = conn
            with self._lock:
                if self._closed:
                    raise ExchangeError("client closed")
                self._open.add(conn)
        conn.timeout = timeout  # used when it (re)connects
        return conn, False

    def request(
        self,
        method: str,
        path: str,
        params: dict[str, str] | None,
        body: bytes | None,
        timeout: float,
    ) -> tuple[int, bytes]:
        target = self._prefix + path + (f"?{urlencode(params)}" if params else "")
        headers = self._headers()
        for attempt in (1, 2):
            conn, reused = self._connection(timeout)
            try:
                conn.request(method, target, body=body, headers=headers)
                resp = conn.getresponse()
                data = resp.read()
            except (OSError, http.client.HTTPException) as exc:
                conn.close()
                # a kept-alive connection the server closed meanwhile: once more, on a new one
                stale = isinstance(exc, (ConnectionResetError, BrokenPipeError))
                if reused and stale and attempt == 1 and not self._closed:
                    continue
                raise ExchangeError(f"{method} {target}: {exc!r}") from exc
            if resp.will_close or self._closed:  # closed meanwhile: this socket is ours to close
                conn.close()
            return resp.status, data
        raise AssertionError("unreachable")

    def close(self) -> None:
        with self._lock:
            self._closed = True
            conns, self._open = self._open, set()
        for conn in conns:
            conn.close()


class HttpxExchange:
    def __init__(self, base_url: str, headers: Headers, transport: httpx.BaseTransport) -> None:
        self._http = httpx.Client(base_url=base_url, transport=transport)
        self._headers = headers_of(headers)

    def request(
        self,
        method: str,
        path: str,
        params: dict[str, str] | None,
        body: bytes | None,
        timeout: float,
    ) -> tuple[int, bytes]:
        try:
            resp = self._http.request(
                method, path, params=params, content=body, headers=self._headers(), timeout=timeout
            )
        except httpx.TransportError as exc:
            raise ExchangeError(f"{method} {path}: {exc!r}") from exc
        return resp.status_code, resp.content

    def close(self) -> None:
        self._http.close()
