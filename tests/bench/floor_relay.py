"""Lower bounds for the proxy benchmark: how little CPU a Python process can spend per request.

Run by ``proxy_bench.py --floor`` as three extra targets, each its own process (uvloop,
httptools, msgspec, as the proxy uses):

``relay``      the prefill-first relay with nothing but the work itself: one callback per
               event, no tasks, no coroutines, no ASGI, no metrics, no timeouts, no error
               handling. Each client connection gets its own connection to P and to D. The
               client's JSON is parsed, P gets it with ``max_tokens=1``, ``stream=false`` and
               ``kv_transfer_params``; P's answer is parsed for its ``kv_transfer_params``,
               which go to D; D's answer (JSON or SSE, any framing) is passed to the client
               byte for byte. Not a router: the floor a Python router's CPU per request is
               measured against.
``echo-lean``  a fixed answer per request from a bare httptools protocol, the handler a task
               of its own per request (what a lean server for the hot paths would do).
``echo-asgi``  the same fixed answer from an ASGI app under uvicorn with the proxy's own
               protocol class (``proxy.server``), as the proxy serves its hot paths today.

``echo-asgi`` minus ``echo-lean`` is what uvicorn's request cycle costs per request.

    python tests/bench/floor_relay.py relay P_URL D_URL --port PORT
    python tests/bench/floor_relay.py echo-lean --port PORT
    python tests/bench/floor_relay.py echo-asgi --port PORT
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any, cast
from urllib.parse import urlsplit

import httptools
import msgspec
import uvloop

ANSWER = (
    b'{"id":"cmpl-floor","object":"text_completion","model":"m","choices":[{"index":0,'
    b'"text":" a b c d e f g h i j k l m n o p","finish_reason":"length"}],'
    b'"usage":{"prompt_tokens":40,"completion_tokens":16,"total_tokens":56}}'
)
_enc = msgspec.json.Encoder()
_dec = msgspec.json.Decoder()


class _Upstream(asyncio.Protocol):
    """One kept-alive connection to P or D; ``on_done`` gets P's whole body, ``on_bytes`` D's
    raw response bytes as they come."""

    def __init__(self, host: bytes) -> None:
        self._host = host
        self._parser = httptools.HttpResponseParser(self)
        self._body: list[bytes] = []
        self.on_done: Callable[[bytes], None] | None = None
        self.on_bytes: Callable[[bytes], None] | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's is not a subclass

    def data_received(self, data: bytes) -> None:
        if self.on_bytes is not None:
            self.on_bytes(data)
        self._parser.feed_data(data)

    def on_body(self, body: bytes) -> None:
        if self.on_bytes is None:  # D's answer went out as it came: nothing to keep
            self._body.append(body)

    def on_message_complete(self) -> None:
        done, self.on_done, self.on_bytes = self.on_done, None, None
        if done is not None:
            body = b"".join(self._body)
            self._body = []
            done(body)

    def post(self, path: bytes, body: bytes) -> None:
        self.transport.write(
            b"POST %s HTTP/1.1\r\nhost: %s\r\ncontent-type: application/json\r\n"
            b"content-length: %d\r\n\r\n%s" % (path, self._host, len(body), body)
        )


class _Relay(asyncio.Protocol):
    def __init__(self, p: tuple[str, int], d: tuple[str, int]) -> None:
        self._parser = httptools.HttpRequestParser(self)
        self._body: list[bytes] = []
        self._req: dict[str, Any] = {}
        self._url = b""
        loop = asyncio.get_running_loop()
        self._ready = loop.create_task(self._connect(loop, p, d))

    async def _connect(
        self, loop: asyncio.AbstractEventLoop, p: tuple[str, int], d: tuple[str, int]
    ) -> None:
        _, self._p = await loop.create_connection(lambda: _Upstream(b"p"), *p)
        _, self._d = await loop.create_connection(lambda: _Upstream(b"d"), *d)

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's is not a subclass

    def connection_lost(self, exc: Exception | None) -> None:
        if not self._ready.done():
            self._ready.cancel()
            return
        for up in (getattr(self, "_p", None), getattr(self, "_d", None)):
            if up is not None:
                up.transport.close()

    def data_received(self, data: bytes) -> None:
        self._parser.feed_data(data)

    def on_url(self, url: bytes) -> None:
        self._url = url

    def on_body(self, body: bytes) -> None:
        self._body.append(body)

    def on_message_complete(self) -> None:
        if self._parser.get_method() == b"GET":  # the bench's readiness probe
            self.transport.write(b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\n\r\n")
            return
        self._req = _dec.decode(b"".join(self._body))
        self._body = []
        p_body = {k: v for k, v in self._req.items() if k != "stream_options"}
        p_body["max_tokens"] = 1
        p_body["stream"] = False
        p_body["kv_transfer_params"] = {"do_remote_decode": True, "do_remote_prefill": False}
        raw = _enc.encode(p_body)
        if self._ready.done():
            self._send_p(raw)
        else:
            self._ready.add_done_callback(lambda _: self._send_p(raw))

    def _send_p(self, raw: bytes) -> None:
        self._p.on_done = self._on_p
        self._p.post(self._url, raw)

    def _on_p(self, body: bytes) -> None:
        kv = _dec.decode(body).get("kv_transfer_params")
        self._d.on_bytes = self.transport.write
        self._d.on_done = _ignore
        self._d.post(self._url, _enc.encode({**self._req, "kv_transfer_params": kv}))


def _ignore(_: bytes) -> None:
    pass


class _EchoLean(asyncio.Protocol):
    def __init__(self) -> None:
        self._parser = httptools.HttpRequestParser(self)
        self._loop = asyncio.get_running_loop()
        self._headers: list[tuple[bytes, bytes]] = []
        self._body: list[bytes] = []

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's is not a subclass

    def data_received(self, data: bytes) -> None:
        self._parser.feed_data(data)

    def on_message_begin(self) -> None:
        self._headers = []
        self._body = []

    def on_header(self, name: bytes, value: bytes) -> None:
        self._headers.append((name.lower(), value))

    def on_body(self, body: bytes) -> None:
        self._body.append(body)

    def on_message_complete(self) -> None:
        self._loop.create_task(self._answer(b"".join(self._body)))

    async def _answer(self, body: bytes) -> None:
        headers = ((b"content-type", b"application/json"), (b"content-length", b"%d" % len(ANSWER)))
        head = b"".join(b"%s: %s\r\n" % h for h in headers)
        self.transport.write(b"HTTP/1.1 200 OK\r\n%s\r\n%s" % (head, ANSWER))


async def _echo_asgi(scope: dict[str, Any], receive: Any, send: Any) -> None:
    if scope["type"] != "http":
        return
    more = True
    while more:
        more = (await receive()).get("more_body", False)
    headers = [(b"content-type", b"application/json"), (b"content-length", b"%d" % len(ANSWER))]
    await send({"type": "http.response.start", "status": 200, "headers": headers})
    await send({"type": "http.response.body", "body": ANSWER})


async def _serve(factory: Callable[[], asyncio.Protocol], port: int) -> None:
    loop = asyncio.get_running_loop()
    server = await loop.create_server(factory, "127.0.0.1", port, backlog=4096)
    await server.serve_forever()


def _host_port(url: str) -> tuple[str, int]:
    parts = urlsplit(url)
    assert parts.hostname and parts.port, url
    return parts.hostname, parts.port


def main(argv: list[str]) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("kind", choices=("relay", "echo-lean", "echo-asgi"))
    ap.add_argument("upstreams", nargs="*", metavar="URL", help="relay: P's and D's base URLs")
    ap.add_argument("--port", type=int, required=True)
    args = ap.parse_args(argv)
    kind, port = args.kind, args.port
    if kind == "relay":
        if len(args.upstreams) != 2:
            ap.error("relay needs P's and D's base URLs")
        p, d = _host_port(args.upstreams[0]), _host_port(args.upstreams[1])
        uvloop.run(_serve(lambda: _Relay(p, d), port))
    elif kind == "echo-lean":
        uvloop.run(_serve(_EchoLean, port))
    else:
        import uvicorn

        sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
        uvicorn.run(
            _echo_asgi, host="127.0.0.1", port=port, loop="uvloop", log_level="warning",
            http="proxy.server:CoalescingHttpToolsProtocol", access_log=False, backlog=4096,
            proxy_headers=False, server_header=False,
        )  # fmt: skip


if __name__ == "__main__":
    main(sys.argv[1:])
