"""Relay D's answer to the client: SSE bytes passed through as they come.

A stream that breaks (connection lost, idle timeout) or ends without ``data: [DONE]`` is closed
with an SSE error event and ``[DONE]`` — never a silent truncation. When P reported cached
tokens and the client asked for usage, the usage event is rewritten (events are then split
on their boundaries; otherwise chunks are forwarded untouched).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from pdwire.asgi import Send
from proxy.errors import UpstreamError, sse_error_event
from proxy.flows import Upstream
from proxy.rewrite import decode, encode, merge_usage

log = logging.getLogger("pdgate.proxy.sse")
_DONE = b"data: [DONE]"


def _body(chunk: bytes) -> dict[str, Any]:
    return {"type": "http.response.body", "body": chunk, "more_body": True}


def _last(chunk: bytes) -> dict[str, Any]:
    return {"type": "http.response.body", "body": chunk, "more_body": False}


async def relay_stream(
    up: Upstream, send: Send, merge: bool, on_done: Callable[[], None] | None = None
) -> bool:
    """Forward the stream (each chunk as it comes) and end the client's response; return True
    when D's stream ended cleanly with ``[DONE]``. ``on_done`` runs once ``[DONE]`` has been
    passed on: from then on the client has the whole answer (and may hang up)."""
    next_chunk = up.resp.next_chunk
    fix = _UsageFixer(up.prefill_cached) if merge and up.prefill_cached is not None else None
    chunk = up.first
    tail = b""
    try:
        while chunk:
            tail = chunk[-32:] if len(chunk) >= 32 else (tail + chunk)[-32:]
            await send(_body(fix.feed(chunk) if fix else chunk))
            if on_done is not None and _DONE in tail and (fix is None or not fix.pending):
                on_done()
                on_done = None
            chunk = await next_chunk()
        if fix is not None and fix.pending:
            await send(_body(fix.flush()))
    except UpstreamError as exc:
        log.warning("decode stream %s broke: %s", up.tid, exc.message)
        await send(_last(sse_error_event(f"decode stream broke: {exc.message}")))
        return False
    if _DONE not in tail:
        log.warning("decode stream %s ended without [DONE]", up.tid)
        await send(_last(sse_error_event("decode stream ended early")))
        return False
    await send(_last(b""))
    return True


class _UsageFixer:
    __slots__ = ("cached", "pending")

    def __init__(self, cached: int | None) -> None:
        self.cached = cached
        self.pending = b""

    def feed(self, chunk: bytes) -> bytes:
        buf = self.pending + chunk
        cut = buf.rfind(b"\n\n")
        if cut < 0:
            self.pending = buf
            return b""
        ready, self.pending = buf[: cut + 2], buf[cut + 2 :]
        if b'"usage":{' not in ready and b'"usage": {' not in ready:
            return ready
        return b"".join(self._fix(ev) + b"\n\n" for ev in ready.split(b"\n\n") if ev)

    def flush(self) -> bytes:
        out, self.pending = self.pending, b""
        return out

    def _fix(self, event: bytes) -> bytes:
        if not event.startswith(b"data: {") or b'"usage"' not in event:
            return event
        try:
            obj = decode(event[6:])
        except ValueError:
            return event
        if isinstance(obj, dict) and merge_usage(obj.get("usage"), self.cached):
            return b"data: " + encode(obj)
        return event


def fix_body(raw: bytes, cached: int | None) -> bytes:
    """Non-streaming answer: merge P's cached tokens into ``usage``."""
    if cached is None:
        return raw
    try:
        obj = decode(raw)
    except ValueError:
        return raw
    if isinstance(obj, dict) and merge_usage(obj.get("usage"), cached):
        return encode(obj)
    return raw
