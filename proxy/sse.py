"""Relay D's answer to the client: SSE bytes passed through as they come.

A stream that breaks (connection lost, idle timeout) or ends without ``data: [DONE]`` is
reported to the caller, which continues it on another pair (``proxy.migration``) or closes it
with an SSE error event and ``[DONE]`` — never a silent truncation. With an event hook (the
migration's record of the answer) or when P reported cached tokens and the client asked for
usage, events are split on their boundaries and passed through the hook / the usage fix;
otherwise chunks are forwarded untouched.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any, NamedTuple

from pdservice.asgi import Send
from proxy.errors import UpstreamError, UpstreamTimeout, sse_error_event
from proxy.flows import Upstream
from proxy.rewrite import decode, encode, merge_usage

log = logging.getLogger("pdgate.proxy.sse")
_DONE = b"data: [DONE]"


def _body(chunk: bytes) -> dict[str, Any]:
    return {"type": "http.response.body", "body": chunk, "more_body": True}


def _last(chunk: bytes) -> dict[str, Any]:
    return {"type": "http.response.body", "body": chunk, "more_body": False}


class Broken(NamedTuple):
    """Why D's stream ended without ``[DONE]``: ``reason`` a metric label (``broken``,
    ``timeout``, ``ended_early``), ``message`` the client's error text."""

    reason: str
    message: str


EventHook = Callable[[bytes], bytes | None]
"""An event's JSON (``data: `` removed) -> what the client gets instead (``None``: nothing)."""


async def relay_stream(
    up: Upstream,
    send: Send,
    merge: bool,
    on_done: Callable[[], None] | None = None,
    hook: EventHook | None = None,
) -> Broken | None:
    """Forward the stream (each chunk as it comes). Returns ``None`` when D's stream ended
    cleanly with ``[DONE]`` (the client's response is then ended), else why it broke (the
    response is left open: ``end_broken`` ends it, or the answer goes on from elsewhere).
    ``on_done`` runs once ``[DONE]`` has been passed on: from then on the client has the whole
    answer (and may hang up). ``hook``: each event is passed through it (split on event
    boundaries); without one, chunks go out untouched."""
    cached = up.prefill_cached if merge else None
    if hook is not None:
        return await _relay_events(up, send, hook, cached, on_done)
    next_chunk = up.resp.next_chunk
    fix = _UsageFixer(cached) if cached is not None else None
    chunk = up.first
    tail = b""
    try:
        while chunk:
            up.chunks += 1
            tail = chunk[-32:] if len(chunk) >= 32 else (tail + chunk)[-32:]
            await send(_body(fix.feed(chunk) if fix else chunk))
            if on_done is not None and _DONE in tail and (fix is None or not fix.pending):
                on_done()
                on_done = None
            chunk = await next_chunk()
        if fix is not None and fix.pending:
            await send(_body(fix.flush()))
    except UpstreamError as exc:
        return _broke(up, exc)
    if _DONE not in tail:
        return _ended_early(up)
    await send(_last(b""))
    return None


async def _relay_events(
    up: Upstream,
    send: Send,
    hook: EventHook,
    cached: int | None,
    on_done: Callable[[], None] | None,
) -> Broken | None:
    next_chunk = up.resp.next_chunk
    chunk = up.first
    pending = b""
    done = False
    try:
        while chunk:
            up.chunks += 1
            buf = pending + chunk if pending else chunk
            cut = buf.rfind(b"\n\n")
            if cut < 0:
                pending = buf
            else:
                ready, pending = buf[: cut + 2], buf[cut + 2 :]
                if cut == ready.find(b"\n\n") and ready.startswith(b"data: {"):
                    out = _event(ready[6:cut], hook, cached)  # one event: the usual chunk
                else:
                    out, done = _events(ready, hook, cached)
                if out:
                    await send(_body(out))
                if done and on_done is not None:
                    on_done()
                    on_done = None
            chunk = await next_chunk()
    except UpstreamError as exc:
        return _broke(up, exc)
    if not done:
        return _ended_early(up)
    await send(_last(b""))
    return None


def _event(payload: bytes, hook: EventHook, cached: int | None) -> bytes:
    got = hook(payload)
    if got is None:
        return b""
    ev = b"data: " + got
    return (_fix_usage(ev, cached) if cached is not None else ev) + b"\n\n"


def _events(ready: bytes, hook: EventHook, cached: int | None) -> tuple[bytes, bool]:
    """Whole events (``ready`` ends with one) through ``hook``; whether ``[DONE]`` came."""
    out: list[bytes] = []
    done = False
    for ev in ready.split(b"\n\n"):
        if ev.startswith(b"data: {"):
            out.append(_event(ev[6:], hook, cached))
        elif ev:
            done = done or ev.startswith(_DONE)
            out.append(ev + b"\n\n")
    return b"".join(out), done


def _broke(up: Upstream, exc: UpstreamError) -> Broken:
    log.warning("decode stream %s broke: %s", up.tid, exc.message)
    reason = "timeout" if isinstance(exc, UpstreamTimeout) else "broken"
    return Broken(reason, f"decode stream broke: {exc.public}")


def _ended_early(up: Upstream) -> Broken:
    log.warning("decode stream %s ended without [DONE]", up.tid)
    return Broken("ended_early", "decode stream ended early")


async def end_broken(send: Send, broken: Broken, why: str = "") -> None:
    """End a broken stream for the client: an SSE error event (``why``: appended to its
    message) and ``[DONE]``."""
    message = f"{broken.message} ({why})" if why else broken.message
    await send(_last(sse_error_event(message)))


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
        return _fix_usage(event, self.cached)


def _fix_usage(event: bytes, cached: int | None) -> bytes:
    """One event with P's cached tokens merged into its ``usage`` (if it has one)."""
    if not event.startswith(b"data: {") or b'"usage"' not in event:
        return event
    try:
        obj = decode(event[6:])
    except ValueError:
        return event
    if isinstance(obj, dict) and merge_usage(obj.get("usage"), cached):
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
