"""The data-path HTTP seam: POST a leg to a backend, read its answer, map failures.

Two implementations sit behind it, chosen by ``--http-client``: ``proxy.native`` (a lean
HTTP/1.1 client on ``asyncio.Protocol`` + httptools, the default) and ``proxy.aiohttp_backend``
(aiohttp's pooled client). Flows and the SSE relay only see ``Backend`` and ``Response``.
"""

from __future__ import annotations

from typing import Protocol

from proxy.errors import UpstreamError, UpstreamRejected, UpstreamTimeout


class LegError(UpstreamError):
    """An upstream failure that names the instance to blame (circuit breaker, exclusion)."""

    def __init__(self, cause: UpstreamError, url: str, leg: str) -> None:
        super().__init__(f"{leg} {url}: {cause.message}")
        self.status = cause.status
        self.kind = cause.kind
        self.retryable = cause.retryable
        self.cause = cause
        self.url = url
        self.leg = leg

    @property
    def public(self) -> str:
        """Which leg, and how it failed; never the instance's address or what it said."""
        if isinstance(self.cause, UpstreamRejected):
            return self.cause.public
        how = "did not answer in time" if isinstance(self.cause, UpstreamTimeout) else "failed"
        return f"the {self.leg} leg {how}"

    def body(self) -> bytes:
        return self.cause.body() if isinstance(self.cause, UpstreamRejected) else super().body()


class Response(Protocol):
    """A 2xx answer whose headers are in. Reads raise ``UpstreamError`` (``UpstreamTimeout``
    when ``timeout_s`` — or, for ``next_chunk`` without one, the idle timeout — passes)."""

    status: int

    @property
    def content_type(self) -> bytes: ...

    async def read(self, timeout_s: float) -> bytes:
        """The whole (rest of the) body."""
        ...

    async def next_chunk(self, timeout_s: float | None = None) -> bytes:
        """Whatever arrived since the last call (waiting for something); ``b""`` at the end."""
        ...

    def release(self) -> None:
        """The body was read to its end: the connection may be reused."""
        ...

    def close(self) -> None:
        """Drop the connection (an unfinished vLLM request is aborted)."""
        ...


class Backend(Protocol):
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
        """Send a leg; return once the answer's headers are in (within ``timeout_s``).
        ``traceparent`` (tracing on) goes out as that header. Raises ``LegError``:
        transport failures, timeouts, non-2xx answers."""
        ...

    async def get(
        self, url: str, headers: dict[str, str] | None, timeout_s: float
    ) -> tuple[int, bytes]:
        """A small GET (the metaserver's binding long-poll): status and body, any status.
        Raises ``UpstreamError`` on transport failures and timeouts."""
        ...

    async def close(self) -> None: ...


def status_error(status: int, raw: bytes, url: str, leg: str) -> LegError:
    """A non-2xx answer as the error the dispatcher expects: the backend's own 4xx goes back
    to the client (never retried); 408, 429, 5xx and an engine refusing the proxy's own
    credentials (401, 403: a misconfigured engine, not the client's fault) are retryable."""
    if 400 <= status < 500 and status not in (401, 403, 408, 429):
        return LegError(UpstreamRejected(status, raw), url, leg)
    if status in (401, 403):  # the engine refused the proxy's credentials: not the client's
        msg = f"answered {status}: the engine refused the proxy (--engine-api-key-file?)"
        return LegError(UpstreamError(msg), url, leg)
    msg = f"answered {status}: {raw[:300].decode(errors='replace')}"
    return LegError(UpstreamError(msg), url, leg)
