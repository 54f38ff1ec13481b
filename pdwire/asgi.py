"""ASGI types, and reading a request body: one definition for the proxy and the metaserver."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]


class ClientDisconnected(Exception):
    """The client went away before its request body was complete: nothing is processed and
    nothing can be answered."""


class BodyTooLarge(Exception):
    def __init__(self, limit: int) -> None:
        super().__init__(f"request body exceeds {limit} bytes")
        self.limit = limit


async def read_body(receive: Receive, limit: int, declared: int = -1) -> bytes:
    """The whole request body; ``BodyTooLarge`` past ``limit`` bytes (``declared``: the
    Content-Length, checked first), ``ClientDisconnected`` if the client leaves first."""
    if declared > limit:
        raise BodyTooLarge(limit)
    chunks: list[bytes] = []
    seen = 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise ClientDisconnected
        chunk: bytes = message.get("body", b"")
        seen += len(chunk)
        if seen > limit:
            raise BodyTooLarge(limit)
        chunks.append(chunk)
        if not message.get("more_body"):
            return chunks[0] if len(chunks) == 1 else b"".join(chunks)
