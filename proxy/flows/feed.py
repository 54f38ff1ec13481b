"""The proxy's binding feed: one stream from the metaserver carrying every binding created for
this process's transfers (``GET /v1/feeds/bindings?prefix=``; format in ``pdwire.feed``), so a
decode-first or ascend-layerwise request waits on a local future instead of its own long-poll.
Its prefixes: the process's transfer ids, and vllm-ascend D's request ids made of them.

A request uses the feed only when the feed is live as it starts waiting (the waiter is in
place before D is sent anything, so D's binding cannot come first). When the feed goes down —
``lost``, closed, silent for three keepalives — every waiter gets ``None`` and reads its binding
with a long-poll for the time it has left (``BindingSource``); a new feed is opened with backoff.
A metaserver without feeds (404) is retried every minute; long-polls serve meanwhile.
"""

from __future__ import annotations

import asyncio
import logging

import aiohttp
import msgspec

from pdwire.client import auth_headers
from pdwire.feed import FeedLineInvalid, Signal, feed_url, parse_line

log = logging.getLogger("pdgate.proxy.feed")

_BACKOFF_S = (0.1, 30.0)  # first and last delay between attempts
_MISSING_S = 60.0  # the metaserver has no feed endpoint (an older release)


def _expire(fut: asyncio.Future[msgspec.Raw | None]) -> None:
    if not fut.done():
        fut.set_result(None)


class BindingFeed:
    def __init__(
        self,
        session: aiohttp.ClientSession,
        base_url: str,
        token: str | None,
        prefixes: tuple[str, ...],
        keepalive_s: float = 1.0,
    ) -> None:
        self.prefixes = prefixes  # ``str.startswith`` takes the tuple
        self.live = False
        self._session = session
        self._url = feed_url(base_url, prefixes, keepalive_s)
        self._headers = auth_headers(token)
        self._silence_s = 3 * keepalive_s
        self._waiters: dict[str, asyncio.Future[msgspec.Raw | None]] = {}
        self._went_live = False  # during the current connection

    async def wait(self, transfer_id: str, timeout_s: float) -> msgspec.Raw | None:
        """The binding, or ``None`` when the feed went down or ``timeout_s`` passed first."""
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[msgspec.Raw | None] = loop.create_future()
        self._waiters[transfer_id] = fut
        timer = loop.call_later(timeout_s, _expire, fut)
        try:
            return await fut
        finally:
            timer.cancel()
            self._waiters.pop(transfer_id, None)

    def _down(self) -> None:
        self.live = False
        for fut in self._waiters.values():
            if not fut.done():
                fut.set_result(None)

    def _on_line(self, line: bytes) -> None:
        try:
            got = parse_line(line)
        except FeedLineInvalid as exc:
            log.warning("binding feed: %s", exc)
            return
        if got.transfer_id is not None:
            fut = self._waiters.get(got.transfer_id)
            if fut is not None and not fut.done():
                fut.set_result(got.binding)
        elif got.signal is Signal.LIVE:
            self.live = self._went_live = True
            log.info("binding feed live (prefixes %s)", ", ".join(self.prefixes))
        elif got.signal is Signal.LOST:
            log.warning("binding feed lost (bindings may have been missed); long-polls meanwhile")
            self._down()

    async def _read(self) -> None:
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=5, sock_read=self._silence_s)
        async with self._session.get(self._url, headers=self._headers, timeout=timeout) as resp:
            if resp.status != 200:
                raise _Refused(resp.status, (await resp.read())[:200])
            rest = b""
            async for chunk in resp.content.iter_any():
                *lines, rest = (rest + chunk).split(b"\n")
                for line in lines:
                    if line:
                        self._on_line(line)

    async def run(self) -> None:
        """Keep a feed open for as long as the proxy runs."""
        delay = _BACKOFF_S[0]
        while True:
            self._went_live = False
            try:
                await self._read()
            except asyncio.CancelledError:
                self._down()
                raise
            except _Refused as exc:
                log.warning("binding feed refused (%s); long-polls until it is offered", exc)
                self._down()
                await asyncio.sleep(_MISSING_S if exc.status == 404 else _BACKOFF_S[1])
                continue
            except (aiohttp.ClientError, TimeoutError, OSError) as exc:
                level = logging.WARNING if self.live else logging.DEBUG
                log.log(level, "binding feed down (%r); long-polls meanwhile", exc)
            else:
                if self.live:
                    log.warning("binding feed closed by the metaserver; long-polls meanwhile")
            self._down()
            delay = _BACKOFF_S[0] if self._went_live else min(delay * 2, _BACKOFF_S[1])
            await asyncio.sleep(delay)


class _Refused(Exception):
    def __init__(self, status: int, body: bytes) -> None:
        super().__init__(f"{status}: {body.decode(errors='replace')}")
        self.status = status
