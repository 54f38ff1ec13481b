"""D's binding on the data path: from the process's binding feed while it is live
(``proxy.flows.feed``), else the long-poll ``GET /v1/bindings/{id}?wait=S`` on the data-path
HTTP client. The metaserver's JSON is kept as raw bytes (``msgspec.Raw``) and embedded in P's
request as it came — no model parse and dump per request."""

from __future__ import annotations

import asyncio

import msgspec

from pdwire.client import auth_headers, binding_url
from proxy.backend import Backend
from proxy.errors import UpstreamError
from proxy.flows.feed import BindingFeed
from proxy.metrics import Metrics


class BindingMissing(Exception):
    """The metaserver answered 404: D wrote no binding within the wait."""


class BindingSource:
    def __init__(
        self, backend: Backend, base_url: str, token: str | None, metrics: Metrics
    ) -> None:
        self._backend = backend
        self.base_url = base_url.rstrip("/")
        self._headers = auth_headers(token) or None
        self.feed: BindingFeed | None = None  # set by the runtime once it has a session
        self._metrics = metrics

    async def wait(self, transfer_id: str, wait_s: float) -> msgspec.Raw:
        """D's binding as JSON bytes; ``BindingMissing`` if it never appeared; ``UpstreamError``
        when the metaserver fails."""
        feed = self.feed
        if feed is not None and feed.live and transfer_id.startswith(feed.prefixes):
            loop = asyncio.get_running_loop()
            deadline = loop.time() + wait_s
            raw = await feed.wait(transfer_id, wait_s)
            if raw is not None:
                self._metrics.binding_reads_feed.inc()
                return raw
            # the feed went down, or the time ran out: the long-poll reads what is there
            wait_s = max(deadline - loop.time(), 0.05)
        self._metrics.binding_reads_long_poll.inc()
        url = binding_url(self.base_url, transfer_id, wait_s)
        status, body = await self._backend.get(url, self._headers, wait_s + 5.0)
        if status == 200 and body[:1] == b"{":
            return msgspec.Raw(body)
        if status == 404:
            raise BindingMissing(transfer_id)
        raise UpstreamError(f"metaserver answered {status}: {body[:300].decode(errors='replace')}")
