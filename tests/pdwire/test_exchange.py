"""``PlainExchange``: one kept-alive connection per thread, and none left open once closed, not
even by a thread that calls again after ``close()`` (``http.client`` reconnects a closed
connection by itself: that socket would belong to nobody)."""

from __future__ import annotations

import socket
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from pdwire.client.exchange import ExchangeError, PlainExchange


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    accepted = 0

    def get_request(self) -> tuple[socket.socket, object]:
        got = super().get_request()
        self.accepted += 1
        return got


class _Ok(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def do_GET(self) -> None:
        self.send_response(200)
        self.send_header("content-length", "2")
        self.end_headers()
        self.wfile.write(b"ok")

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def server() -> Iterator[_Server]:
    srv = _Server(("127.0.0.1", 0), _Ok)
    thread = threading.Thread(target=srv.serve_forever, daemon=True)
    thread.start()
    try:
        yield srv
    finally:
        srv.shutdown()
        srv.server_close()


def _url(srv: _Server) -> str:
    return f"http://127.0.0.1:{srv.server_address[1]}"


def test_exchange_keeps_one_connection_per_thread(server: _Server) -> None:
    ex = PlainExchange(_url(server), {})
    try:
        for _ in range(3):
            assert ex.request("GET", "/x", None, None, 5.0) == (200, b"ok")
    finally:
        ex.close()
    assert server.accepted == 1


def test_exchange_after_close_refuses_instead_of_reconnecting(server: _Server) -> None:
    ex = PlainExchange(_url(server), {})
    assert ex.request("GET", "/x", None, None, 5.0) == (200, b"ok")
    ex.close()
    with pytest.raises(ExchangeError, match="client closed"):
        ex.request("GET", "/x", None, None, 5.0)
    assert server.accepted == 1


def test_exchange_closed_mid_request_closes_that_connection(server: _Server) -> None:
    ex = PlainExchange(_url(server), {})
    assert ex.request("GET", "/x", None, None, 5.0) == (200, b"ok")
    conn = ex._local.conn
    ex._closed = True  # close() ran while this thread's request was on the wire
    ex._open.discard(conn)  # ... after taking the set of connections to close
    assert ex.request("GET", "/x", None, None, 5.0) == (200, b"ok")
    assert conn.sock is None  # the thread closed it itself
