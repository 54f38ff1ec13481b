"""A metaserver client's token from a file, re-read when the file changes (Kubernetes rotates
projected ServiceAccount tokens in place), looked at no more than once per ``check_s``."""

from __future__ import annotations

import asyncio
import os
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from pdwire.client import AsyncMetaserverClient, MetaserverClient
from pdwire.client import _protocol as P
from pdwire.client.token import FileToken


class Clock:
    def __init__(self) -> None:
        self.now = 10.0

    def __call__(self) -> float:
        return self.now


def rotate(path: Path, token: str) -> None:
    """As the kubelet does: the new file is written aside, then swapped in at once."""
    aside = path.with_name(path.name + ".new")
    aside.write_text(token + "\n")
    os.replace(aside, path)


def test_a_rotated_file_is_read_again_after_the_check_interval(tmp_path: Path) -> None:
    path = tmp_path / "token"
    path.write_text("first-token\n")
    clock = Clock()
    token = FileToken(str(path), check_s=1.0, clock=clock)
    assert token() == "first-token"
    rotate(path, "second-token")
    assert token() == "first-token"  # not looked at again yet
    clock.now += 1.0
    assert token() == "second-token"
    path.unlink()  # gone for a moment: the last token stays in use
    clock.now += 1.0
    assert token() == "second-token"
    assert "second" not in repr(token)


def test_between_checks_a_use_costs_no_file_access(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "token"
    path.write_text("tok\n")
    clock = Clock()
    token = FileToken(str(path), check_s=1.0, clock=clock)
    stats: list[str] = []
    real_stat = os.stat

    def counted(p: str, *args: object, **kwargs: object) -> os.stat_result:
        stats.append(str(p))
        return real_stat(p)

    monkeypatch.setattr(os, "stat", counted)
    for _ in range(1000):
        token()
    assert stats == []
    clock.now += 1.0
    token()
    token()
    assert stats == [str(path)]


def test_a_token_file_that_cannot_work_fails_at_start(tmp_path: Path) -> None:
    empty = tmp_path / "empty"
    empty.write_text("\n")
    with pytest.raises(ValueError, match="empty"):
        FileToken(str(empty))
    with pytest.raises(ValueError, match="No such file"):
        FileToken(str(tmp_path / "missing"))


class Seen(BaseHTTPRequestHandler):
    tokens: list[str] = []

    def do_GET(self) -> None:
        Seen.tokens.append(self.headers.get("authorization", ""))
        body = b"{}"
        self.send_response(200)
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def server() -> Iterator[str]:
    Seen.tokens = []
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Seen)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{httpd.server_address[1]}"
    finally:
        httpd.shutdown()
        httpd.server_close()


def test_both_clients_send_the_token_the_file_holds_now(server: str, tmp_path: Path) -> None:
    path = tmp_path / "token"
    path.write_text("old-token\n")
    clock = Clock()
    token = FileToken(str(path), clock=clock)
    sync = MetaserverClient(server, token=token)

    async def one_async_call() -> None:
        client = AsyncMetaserverClient(server, token=token)
        try:
            await client.send(P.READY)
        finally:
            await client.close()

    try:
        sync.send(P.READY)
        asyncio.run(one_async_call())
        rotate(path, "new-token")
        clock.now += 5
        sync.send(P.READY)
        asyncio.run(one_async_call())
    finally:
        sync.close()
    assert Seen.tokens == ["Bearer old-token"] * 2 + ["Bearer new-token"] * 2
