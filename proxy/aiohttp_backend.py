"""``--http-client aiohttp``: the data path on aiohttp's pooled keep-alive client.

One ``aiohttp.ClientSession`` is injected; prebuilt timeouts, no auto headers, no
decompression, URLs parsed once per instance and path.
"""

from __future__ import annotations

import asyncio

import aiohttp
from yarl import URL

from proxy.backend import LegError, status_error
from proxy.errors import UpstreamError, UpstreamTimeout

_SKIP = frozenset({"User-Agent", "Accept", "Accept-Encoding"})


class AiohttpResponse:
    __slots__ = ("_idle", "resp", "status")

    def __init__(self, resp: aiohttp.ClientResponse, idle_s: float) -> None:
        self.resp = resp
        self.status = resp.status
        self._idle = idle_s

    @property
    def content_type(self) -> bytes:
        return self.resp.headers.get("content-type", "application/json").encode()

    async def read(self, timeout_s: float) -> bytes:
        try:
            if self.resp.content.is_eof():  # all in already: no timer needed
                return await self.resp.read()
            async with asyncio.timeout(timeout_s):
                return await self.resp.read()
        except TimeoutError as exc:
            raise UpstreamTimeout(f"no complete answer in {timeout_s}s") from exc
        except aiohttp.ClientError as exc:
            raise UpstreamError(f"broken answer: {exc!r}") from exc

    async def next_chunk(self, timeout_s: float | None = None) -> bytes:
        try:
            if timeout_s is None:  # the session's sock_read timeout is the idle timeout
                return await self.resp.content.readany()
            async with asyncio.timeout(timeout_s):
                return await self.resp.content.readany()
        except TimeoutError as exc:
            raise UpstreamTimeout(f"no data in {timeout_s or self._idle}s") from exc
        except aiohttp.ClientError as exc:
            raise UpstreamError(f"broken answer: {exc!r}") from exc

    def release(self) -> None:
        self.resp.release()

    def close(self) -> None:
        self.resp.close()


class AiohttpBackend:
    def __init__(
        self,
        session: aiohttp.ClientSession,
        *,
        connect_timeout_s: float,
        idle_timeout_s: float,
        owns_session: bool = False,
        authorization: str | None = None,
    ) -> None:
        """``authorization``: the header every leg carries (the engines' API key)."""
        self.session = session
        self._leg_headers = {"content-type": "application/json"}
        if authorization is not None:
            self._leg_headers["authorization"] = authorization
        self._owns = owns_session
        self._idle = idle_timeout_s
        self._timeout = aiohttp.ClientTimeout(
            total=None, sock_connect=connect_timeout_s, sock_read=idle_timeout_s
        )
        self._urls: dict[tuple[str, str], URL] = {}  # parsed once per instance and path

    async def post(
        self,
        url: str,
        path: str,
        body: bytes,
        request_id: str,
        leg: str,
        timeout_s: float,
        traceparent: str | None = None,
    ) -> AiohttpResponse:
        target = self._urls.get((url, path))
        if target is None:
            target = self._urls[(url, path)] = URL(url + path)
        headers = {**self._leg_headers, "x-request-id": request_id}
        if traceparent is not None:
            headers["traceparent"] = traceparent
        try:
            async with asyncio.timeout(timeout_s):
                resp = await self.session.post(
                    target, data=body, headers=headers, timeout=self._timeout,
                    skip_auto_headers=_SKIP,
                )  # fmt: skip
        except (TimeoutError, aiohttp.ServerTimeoutError) as exc:
            raise LegError(UpstreamTimeout(f"no answer in {timeout_s}s"), url, leg) from exc
        except aiohttp.ClientError as exc:
            raise LegError(UpstreamError(f"connection failed: {exc!r}"), url, leg) from exc
        if resp.status >= 300:
            try:
                async with asyncio.timeout(5):
                    raw = await resp.read()
            except (aiohttp.ClientError, TimeoutError):
                raw = b""
            finally:
                resp.release()
            raise status_error(resp.status, raw, url, leg)
        return AiohttpResponse(resp, self._idle)

    async def get(
        self, url: str, headers: dict[str, str] | None, timeout_s: float
    ) -> tuple[int, bytes]:
        try:
            async with self.session.get(
                url, headers=headers, timeout=aiohttp.ClientTimeout(total=timeout_s)
            ) as r:
                return r.status, await r.read()
        except TimeoutError as exc:
            raise UpstreamTimeout(f"no answer in {timeout_s}s") from exc
        except aiohttp.ClientError as exc:
            raise UpstreamError(f"connection failed: {exc!r}") from exc

    async def close(self) -> None:
        if self._owns:
            await self.session.close()
