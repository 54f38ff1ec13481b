"""What every route needs, held on ``app.state.ctx``: settings, store, metrics, clock."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Annotated

from fastapi import Depends, Request

from metaserver.access import Access, Principal
from metaserver.config import MetaserverSettings
from metaserver.kvindex.streams import Streams
from metaserver.metrics import Metrics
from metaserver.store import Store

if TYPE_CHECKING:
    from metaserver.ascend import DecodeEndpoints
    from metaserver.feeds import FeedHub
    from metaserver.kvindex.manager import KVEventManager


@dataclass
class Context:
    settings: MetaserverSettings
    store: Store
    metrics: Metrics
    clock: Callable[[], float]
    ascend: DecodeEndpoints | None = None  # the vllm-ascend decode pool (metaserver.ascend)
    feeds: FeedHub | None = None  # binding feeds (metaserver.feeds)
    kv_events: KVEventManager | None = None  # --kv-events: engines followed (metaserver.kvindex)

    access: Access | None = None  # built from the settings when not given
    kv_streams: Streams = field(init=False)  # the instances the KV index answers about

    def __post_init__(self) -> None:
        self.kv_streams = Streams(self.store)
        if self.access is None:
            s = self.settings
            token = None if s.token is None else s.token.get_secret_value()
            self.access = Access.load(token, s.credentials_file, s.protect_reads, s.kube_reviewer)

    async def authorize(self, header: str | bytes | None, *, write: bool) -> Principal:
        """The caller (``metaserver.access``) from the request's Authorization header: 401
        without a known token where one is needed, 403 for a reader's write."""
        assert self.access is not None
        return await self.access.resolve(header, write=write)


def ctx(request: Request) -> Context:
    context: Context = request.app.state.ctx
    return context


async def _reading(request: Request) -> Principal:
    return await ctx(request).authorize(request.headers.get("authorization"), write=False)


async def _writing(request: Request) -> Principal:
    return await ctx(request).authorize(request.headers.get("authorization"), write=True)


# the caller of a route, as a FastAPI dependency: 401 / 403 before the route runs
Reader = Annotated[Principal, Depends(_reading)]
Writer = Annotated[Principal, Depends(_writing)]
