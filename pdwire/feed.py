"""The binding feed's wire format, for the metaserver that writes it and the proxy that reads it.

``GET /v1/feeds/bindings?prefix=P[&prefix=Q ...][&keepalive=S]`` answers ``200`` with
``application/x-ndjson``: one JSON object per line, for every binding created from then on whose
transfer id starts with one of the prefixes (at most ``MAX_PREFIXES``). A binding line is
exactly what ``GET /v1/bindings/{id}`` answers (``transfer_id`` is its first key); every other
line is ``{"feed": <signal>}``.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass
from urllib.parse import urlencode

import msgspec

FEED_PATH = "/v1/feeds/bindings"
MEDIA_TYPE = "application/x-ndjson"
PREFIX_PATTERN = r"^[A-Za-z0-9._:-]{4,64}$"  # a prefix of transfer ids (pdwire.ids)
MAX_PREFIXES = 4
DEFAULT_KEEPALIVE_S = 5.0


class Signal(enum.StrEnum):
    LIVE = "live"  # the feed is registered and the store's notifications flow
    KEEPALIVE = "keepalive"  # nothing for ``keepalive`` seconds
    LOST = "lost"  # the last line: bindings may have been missed; read them another way


_SIGNALS = frozenset(s.value for s in Signal)

LIVE_LINE = b'{"feed":"live"}\n'
KEEPALIVE_LINE = b'{"feed":"keepalive"}\n'
LOST_LINE = b'{"feed":"lost"}\n'


def feed_url(
    base_url: str, prefixes: str | Sequence[str], keepalive_s: float = DEFAULT_KEEPALIVE_S
) -> str:
    named = [prefixes] if isinstance(prefixes, str) else list(prefixes)
    query = urlencode([*(("prefix", p) for p in named), ("keepalive", repr(float(keepalive_s)))])
    return f"{base_url.rstrip('/')}{FEED_PATH}?{query}"


class _Line(msgspec.Struct):
    transfer_id: str | None = None
    feed: str | None = None


_decoder = msgspec.json.Decoder(_Line)


@dataclass(frozen=True, slots=True)
class FeedLine:
    """One parsed line: a binding (its id, and the line as it came) or a signal."""

    transfer_id: str | None
    binding: msgspec.Raw | None
    signal: Signal | None


class FeedLineInvalid(ValueError):
    pass


def parse_line(line: bytes) -> FeedLine:
    """One line (without its newline). Raises ``FeedLineInvalid``."""
    try:
        got = _decoder.decode(line)
    except msgspec.DecodeError as exc:
        raise FeedLineInvalid(f"not a feed line: {line[:200]!r}") from exc
    if got.transfer_id is not None:
        return FeedLine(got.transfer_id, msgspec.Raw(line), None)
    if got.feed is not None:  # a signal of a later release is ignored (no binding, no signal)
        return FeedLine(None, None, Signal(got.feed) if got.feed in _SIGNALS else None)
    raise FeedLineInvalid(f"neither a binding nor a signal: {line[:200]!r}")
