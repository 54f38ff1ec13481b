"""``--http-client native``: the ``Backend`` seam on the lean keep-alive client.

https URLs (not used between the proxy and vLLM in a cluster, but allowed) go to the
injected fallback backend (aiohttp).
"""

from __future__ import annotations

from proxy.backend import Backend, LegError, Response, status_error
from proxy.errors import UpstreamError
from proxy.native.connection import NativeResponse
from proxy.native.pool import Pools, Target

_LEG_HEADERS = b"content-type: application/json\r\nx-request-id: "


class NativeBackend:
    def __init__(
        self,
        pools: Pools,
        *,
        idle_timeout_s: float,
        fallback: Backend,
        authorization: str | None = None,
    ) -> None:
        """``authorization``: the header every leg carries (the engines' API key)."""
        self.pools = pools
        auth = b"" if authorization is None else b"authorization: %s\r\n" % authorization.encode()
        self._leg_headers = auth + _LEG_HEADERS
        self._idle = idle_timeout_s
        self._fallback = fallback
        self._targets: dict[tuple[str, str], Target | None] = {}

    def _target(self, url: str, path: str) -> Target | None:
        key = (url, path)
        try:
            return self._targets[key]
        except KeyError:
            pass
        target = Target(url, path) if url.startswith("http://") else None
        if len(self._targets) > 4096:  # instances come and go (discovery): stay bounded
            self._targets.clear()
        self._targets[key] = target
        return target

    async def post(
        self,
        url: str,
        path: str,
        body: bytes,
        request_id: str,
        leg: str,
        timeout_s: float,
        traceparent: str | None = None,
    ) -> Response:
        target = self._target(url, path)
        if target is None:
            return await self._fallback.post(
                url, path, body, request_id, leg, timeout_s, traceparent
            )
        headers = b"%s%s\r\n" % (self._leg_headers, request_id.encode("latin-1"))
        if traceparent is not None:
            headers += b"traceparent: %s\r\n" % traceparent.encode("latin-1")
        resp: NativeResponse | None = None
        try:
            resp = await self.pools.send(target, headers, body, self._idle)
            while not resp.headers_done:
                if resp.error is not None:
                    raise resp.error
                await resp.wait(timeout_s, "answer")
        except UpstreamError as exc:
            if resp is not None:
                resp.close()
            raise LegError(exc, url, leg) from exc
        except BaseException:
            if resp is not None:
                resp.close()
            raise
        if resp.status >= 300:
            try:
                raw = await resp.read(5.0)
            except UpstreamError:
                raw = b""
            resp.release()
            raise status_error(resp.status, raw, url, leg)
        return resp

    async def get(
        self, url: str, headers: dict[str, str] | None, timeout_s: float
    ) -> tuple[int, bytes]:
        if not url.startswith("http://"):
            return await self._fallback.get(url, headers, timeout_s)
        target = Target(url, "", "GET")  # not cached: binding URLs are one per request
        extra = "".join(f"{k}: {v}\r\n" for k, v in (headers or {}).items()).encode("latin-1")
        resp = await self.pools.send(target, extra, b"", self._idle)
        try:
            while not resp.headers_done:
                if resp.error is not None:
                    raise resp.error
                await resp.wait(timeout_s, "answer")
            raw = await resp.read(timeout_s)
        except BaseException:
            resp.close()
            raise
        resp.release()
        return resp.status, raw

    async def close(self) -> None:
        self.pools.close()
        await self._fallback.close()
