"""pd-proxy's uvicorn protocol (``proxy.server``): holding the response head back for the first
body write must never hold back ``100 Continue`` (the client would wait for it forever)."""

from __future__ import annotations

import asyncio
import json

from tests.proxy.conftest import Cluster, ProxyFactory
from tests.proxy.test_flows import PROMPT


async def _raw_request(port: int, head: bytes, body: bytes, expect: bool) -> bytes:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(head)
        await writer.drain()
        if expect:  # the proxy must say "go on" before it has any answer
            interim = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
            assert interim.startswith(b"HTTP/1.1 100 Continue")
        writer.write(body)
        await writer.drain()
        head_out = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
        length = int(head_out.lower().split(b"content-length: ")[1].split(b"\r\n")[0])
        return head_out + await reader.readexactly(length)
    finally:
        writer.close()


async def test_server_expect_100_continue_is_answered_before_the_body(
    cluster: Cluster, proxy_factory: ProxyFactory
) -> None:
    proxy = await proxy_factory(flow="direct")
    port = int(proxy.url.rsplit(":", 1)[1])
    body = json.dumps({"model": "fake-model", "prompt": PROMPT, "max_tokens": 2}).encode()
    head = (
        b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
        b"expect: 100-continue\r\ncontent-length: %d\r\n\r\n" % len(body)
    )
    answer = await _raw_request(port, head, body, expect=True)
    assert answer.startswith(b"HTTP/1.1 200")
    assert json.loads(answer.split(b"\r\n\r\n", 1)[1])["choices"][0]["text"] == "tok0 tok1 "
