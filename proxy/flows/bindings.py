"""D's binding on the data path: from the process's binding feed while it is live
(``proxy.flows.feed``), else the long-poll ``GET /v1/bindings/{id}?wait=S`` on the data-path
HTTP client. The metaserver's JSON is kept as raw bytes (``msgspec.Raw``) and embedded in P's
request as it came — no model parse and dump per request.

A long-poll waits at most ``POLL_S`` per call, and a call not answered ``ANSWER_MARGIN_S`` after
its wait (or refused, or answered 5xx) ends the wait with ``MetaserverUnavailable``: a frozen
metaserver is known within seconds, not after the whole binding wait."""

from __future__ import annotations

import asyncio

import msgspec

from pdwire.client import auth_headers, binding_url
from pdwire.models import BindingState
from proxy.backend import Backend
from proxy.errors import MetaserverUnavailable, UpstreamError
from proxy.flows.feed import BindingFeed
from proxy.metrics import Metrics

TAKEN_READ_S = 2.0  # reading whether P took a binding, after P's leg failed
POLL_S = 2.0  # the longest wait one long-poll asks for
ANSWER_MARGIN_S = 5.0  # a long-poll not answered this long after its wait: metaserver unavailable


class _Event(msgspec.Struct):
    state: BindingState


class _Events(msgspec.Struct):
    """The part of a binding ``taken`` reads."""

    events: list[_Event] = []


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
        """D's binding as JSON bytes; ``BindingMissing`` if it never appeared;
        ``MetaserverUnavailable`` when the metaserver does not answer, refuses or fails (5xx);
        ``UpstreamError`` for any other answer."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + wait_s
        feed = self.feed
        if feed is not None and feed.live and transfer_id.startswith(feed.prefixes):
            raw = await feed.wait(transfer_id, wait_s)
            if raw is not None:
                self._metrics.binding_reads_feed.inc()
                return raw
            # the feed went down, or the time ran out: the long-poll reads what is there
        self._metrics.binding_reads_long_poll.inc()
        while True:
            piece = min(max(deadline - loop.time(), 0.05), POLL_S)
            asked_at = loop.time()
            status, body = await self._poll(transfer_id, piece)
            if status == 200 and body[:1] == b"{":
                return msgspec.Raw(body)
            if status == 404:
                now = loop.time()
                # another piece only while time is left and the metaserver did wait this one
                # (one that answers at once would otherwise be asked in a tight loop)
                if now >= deadline - 0.05 or now - asked_at < piece / 2:
                    raise BindingMissing(transfer_id)
                continue
            what = f"metaserver answered {status}: {body[:300].decode(errors='replace')}"
            if status >= 500:
                raise MetaserverUnavailable(what)
            raise UpstreamError(what)

    async def taken(self, transfer_id: str, timeout_s: float = TAKEN_READ_S) -> bool:
        """Whether P took the binding (a ``prefill_started`` event is on record): one read,
        and False when it cannot be made in ``timeout_s``."""
        url = binding_url(self.base_url, transfer_id)
        try:
            status, body = await self._backend.get(url, self._headers, timeout_s)
            if status != 200:
                return False
            events = msgspec.json.decode(body, type=_Events).events
        except (UpstreamError, msgspec.DecodeError):
            return False
        return any(e.state == BindingState.PREFILL_STARTED for e in events)

    async def _poll(self, transfer_id: str, wait_s: float) -> tuple[int, bytes]:
        url = binding_url(self.base_url, transfer_id, wait_s)
        try:
            return await self._backend.get(url, self._headers, wait_s + ANSWER_MARGIN_S)
        except UpstreamError as exc:
            raise MetaserverUnavailable(exc.message) from exc
