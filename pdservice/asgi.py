"""ASGI types, and reading a request body: one definition for the proxy and the metaserver."""

from __future__ import annotations

import asyncio
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


class BodyTimeout(Exception):
    """The rest of the request body did not arrive within its deadline (a slow sender holds a
    connection and, while it sends, nothing else)."""

    def __init__(self, within_s: float) -> None:
        super().__init__(f"request body not received within {within_s:g}s")
        self.within_s = within_s


class BodyTooLarge(Exception):
    def __init__(self, limit: int) -> None:
        super().__init__(f"request body exceeds {limit} bytes")
        self.limit = limit


async def read_body(
    receive: Receive, limit: int, declared: int = -1, within_s: float | None = None
) -> bytes:
    """The whole request body; ``BodyTooLarge`` past ``limit`` bytes (``declared``: the
    Content-Length, checked first), ``ClientDisconnected`` if the client leaves first,
    ``BodyTimeout`` if parts still missing after the first one take more than ``within_s``
    seconds (no timer when the body comes whole, as a small one does)."""
    if declared > limit:
        raise BodyTooLarge(limit)
    message = await receive()
    if message["type"] == "http.disconnect":
        raise ClientDisconnected
    chunk: bytes = message.get("body", b"")
    if len(chunk) > limit:
        raise BodyTooLarge(limit)
    if not message.get("more_body"):
        return chunk
    if within_s is None:
        return await _rest_of_body(receive, limit, [chunk])
    try:
        async with asyncio.timeout(within_s):
            return await _rest_of_body(receive, limit, [chunk])
    except TimeoutError:
        raise BodyTimeout(within_s) from None


async def _rest_of_body(receive: Receive, limit: int, chunks: list[bytes]) -> bytes:
    seen = len(chunks[0])
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
            return b"".join(chunks)
