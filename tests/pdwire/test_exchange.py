"""``PlainExchange``: one kept-alive connection per thread, and none left open once closed, not
even by a thread that calls again after ``close()`` (``http.client`` reconnects a closed
connection by itself: that socket would belong to nobody)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from pdwire.client.exchange import ExchangeError, PlainExchange
from tests.support.fault_server import FaultServer, Reply, fault_server


@pytest.fixture
def server() -> Iterator[FaultServer]:
    with fault_server(default=Reply(body=b"ok")) as srv:
        yield srv


def test_exchange_keeps_one_connection_per_thread(server: FaultServer) -> None:
    ex = PlainExchange(server.url, {})
    try:
        for _ in range(3):
            assert ex.request("GET", "/x", None, None, 5.0) == (200, b"ok")
    finally:
        ex.close()
    assert server.connections == 1


def test_exchange_after_close_refuses_instead_of_reconnecting(server: FaultServer) -> None:
    ex = PlainExchange(server.url, {})
    assert ex.request("GET", "/x", None, None, 5.0) == (200, b"ok")
    ex.close()
    with pytest.raises(ExchangeError, match="client closed"):
        ex.request("GET", "/x", None, None, 5.0)
    assert server.connections == 1


def test_exchange_closed_mid_request_closes_that_connection(server: FaultServer) -> None:
    ex = PlainExchange(server.url, {})
    assert ex.request("GET", "/x", None, None, 5.0) == (200, b"ok")
    conn = ex._local.conn
    ex._closed = True  # close() ran while this thread's request was on the wire
    ex._open.discard(conn)  # ... after taking the set of connections to close
    assert ex.request("GET", "/x", None, None, 5.0) == (200, b"ok")
    assert conn.sock is None  # the thread closed it itself
