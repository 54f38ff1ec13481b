"""Binding feeds: one long-lived stream per proxy process instead of one long-poll per request.

A proxy process names its transfers with one prefix (``pdwire.ids.IdMaker``) and opens
``GET /v1/feeds/bindings?prefix=P&prefix=cmpl-P&prefix=chatcmpl-P`` once (the last two: the ids
vllm-ascend's D gives its requests). Every binding created from then on whose id starts with
one of them — written by D's connector through any metaserver replica sharing the store — is
sent down that stream as one NDJSON line, the same JSON as ``GET /v1/bindings/{id}``, without being
read back from the store (the store hands over the record it created; ``Store.watch_created``).

Lines (``pdwire.feed`` parses them): ``{"feed":"live"}`` first, once the store's notifications
flow — any binding created after it is sent; then bindings and ``{"feed":"keepalive"}`` every
``keepalive`` seconds; ``{"feed":"lost"}`` last, when notifications may have been missed (a Redis
reconnect, or a reader so slow that ``MAX_BUFFERED`` lines queued up). The reader then reads
what it still waits for with long-polls, and opens a new feed.
"""

from __future__ import annotations

import asyncio
import logging
from collections import Counter
from collections.abc import AsyncIterator, Callable

from metaserver.metrics import Metrics
from metaserver.store.base import Store
from metaserver.store.records import StoredBinding
from pdwire.feed import KEEPALIVE_LINE, LIVE_LINE, LOST_LINE

log = logging.getLogger("pdgate.metaserver")

MAX_BUFFERED = 10_000  # lines queued for one slow reader before its feed is ended ("lost")


class Feed:
    """The lines waiting to be written to one reader."""

    __slots__ = ("_lines", "_wake", "lost", "prefixes")

    def __init__(self, prefixes: tuple[str, ...]) -> None:
        self.prefixes = prefixes
        self._lines: list[bytes] = []
        self._wake = asyncio.Event()
        self.lost = False

    def push(self, line: bytes) -> None:
        if len(self._lines) >= MAX_BUFFERED:
            self.end()
            return
        self._lines.append(line)
        self._wake.set()

    def end(self) -> None:
        self.lost = True
        self._wake.set()

    async def take(self, timeout_s: float) -> list[bytes]:
        """The lines queued so far (waiting up to ``timeout_s`` for one; ``[]`` when none)."""
        if not self._lines and not self.lost:
            try:
                async with asyncio.timeout(timeout_s):
                    await self._wake.wait()
            except TimeoutError:
                return []
        self._wake.clear()
        lines, self._lines = self._lines, []
        return lines


class FeedHub:
    """The open feeds of this process, by prefix; fed by the store's creation notices."""

    def __init__(self, store: Store, metrics: Metrics) -> None:
        self._store = store
        self._metrics = metrics
        self._feeds: dict[str, set[Feed]] = {}
        self._lengths: Counter[int] = Counter()  # prefix lengths in use
        self._unwatch: Callable[[], None] | None = None

    def _on_created(self, record: StoredBinding | None) -> None:
        if record is None:
            for feeds in self._feeds.values():
                for feed in feeds:
                    feed.end()
            return
        tid = record.transfer_id
        line: bytes | None = None
        pushed: set[Feed] | None = None  # a feed whose prefixes nest gets the line once
        for n in self._lengths:
            for feed in self._feeds.get(tid[:n], ()):
                if line is None:
                    line, pushed = record.to_json() + b"\n", set()
                assert pushed is not None
                if feed not in pushed:
                    pushed.add(feed)
                    feed.push(line)

    def _add(self, feed: Feed) -> None:
        if self._unwatch is None:
            self._unwatch = self._store.watch_created(self._on_created)
        for prefix in feed.prefixes:
            self._feeds.setdefault(prefix, set()).add(feed)
            self._lengths[len(prefix)] += 1
        self._metrics.feeds.inc()

    def _remove(self, feed: Feed) -> None:
        for prefix in feed.prefixes:
            feeds = self._feeds[prefix]
            feeds.discard(feed)
            if not feeds:
                del self._feeds[prefix]
            self._lengths[len(prefix)] -= 1
            if not self._lengths[len(prefix)]:
                del self._lengths[len(prefix)]
        self._metrics.feeds.dec()
        if not self._feeds and self._unwatch is not None:
            self._unwatch()
            self._unwatch = None

    async def stream(self, prefixes: tuple[str, ...], keepalive_s: float) -> AsyncIterator[bytes]:
        """The body of one feed response; the feed is registered before the first line."""
        feed = Feed(prefixes)
        self._add(feed)
        try:
            await self._store.notifications_live()
            yield LIVE_LINE
            while True:
                lines = await feed.take(keepalive_s)
                if lines:
                    self._metrics.feed_lines.inc(len(lines))
                    yield b"".join(lines)
                if feed.lost:
                    break
                if not lines:
                    yield KEEPALIVE_LINE
            log.warning(
                "binding feed %s ended: notifications may have been missed", ",".join(prefixes)
            )
            self._metrics.feeds_lost.inc()
            yield LOST_LINE
        finally:
            self._remove(feed)
