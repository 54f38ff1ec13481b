"""ASGI middleware capping request bodies (the proxy's and the metaserver's)."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from pdservice.asgi import ASGIApp, Message, Receive, Scope, Send

ErrorBody = Callable[[str], dict[str, Any]]


def _default_error(message: str) -> dict[str, Any]:
    return {"detail": message}


class _TooLarge(Exception):
    pass


class BodySizeLimit:
    """Answer 413 when the declared or streamed body exceeds ``max_bytes``, before the app
    buffers it. ``error_body`` shapes the JSON error (OpenAI style for the proxy)."""

    def __init__(self, app: ASGIApp, *, max_bytes: int, error_body: ErrorBody = _default_error):
        self.app = app
        self.max_bytes = max_bytes
        self.error_body = error_body

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        for name, value in scope["headers"]:
            if name == b"content-length":
                try:
                    declared = int(value)
                except ValueError:
                    declared = -1
                if declared > self.max_bytes:
                    await self._reject(send)
                    return
                break
        seen = 0
        started = False

        async def limited_receive() -> Message:
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.max_bytes:
                    raise _TooLarge
            return message

        async def tracking_send(message: Message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        try:
            await self.app(scope, limited_receive, tracking_send)
        except _TooLarge:
            if not started:
                await self._reject(send)

    async def _reject(self, send: Send) -> None:
        body = json.dumps(self.error_body(f"request body exceeds {self.max_bytes} bytes")).encode()
        await send(
            {
                "type": "http.response.start",
                "status": 413,
                "headers": [
                    (b"content-type", b"application/json"),
                    (b"content-length", str(len(body)).encode()),
                    (b"connection", b"close"),
                ],
            }
        )
        await send({"type": "http.response.body", "body": body})
