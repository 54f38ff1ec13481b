"""What every route needs, held on ``app.state.ctx``: settings, store, metrics, clock."""

from __future__ import annotations

import hmac
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from fastapi import Request

from metaserver.config import MetaserverSettings
from metaserver.errors import Unauthorized
from metaserver.metrics import Metrics
from metaserver.store import Store

if TYPE_CHECKING:
    from metaserver.ascend import DecodeEndpoints
    from metaserver.feeds import FeedHub


@dataclass
class Context:
    settings: MetaserverSettings
    store: Store
    metrics: Metrics
    clock: Callable[[], float]
    ascend: DecodeEndpoints | None = None  # the vllm-ascend decode pool (metaserver.ascend)
    feeds: FeedHub | None = None  # binding feeds (metaserver.feeds)

    def __post_init__(self) -> None:
        token = self.settings.token
        self._expected = None if token is None else f"Bearer {token.get_secret_value()}".encode()

    def authorize(self, header: str | bytes | None, *, write: bool) -> None:
        """Writes need the token whenever one is configured; reads only with protect_reads.
        ``header`` is the request's Authorization header."""
        if self._expected is None or (not write and not self.settings.protect_reads):
            return
        got = header.encode() if isinstance(header, str) else (header or b"")
        if not hmac.compare_digest(got, self._expected):
            raise Unauthorized("missing or wrong bearer token")


def ctx(request: Request) -> Context:
    context: Context = request.app.state.ctx
    return context
