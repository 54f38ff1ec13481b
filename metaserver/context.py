"""What every route needs, held on ``app.state.ctx``: settings, the backend (store, KV index, load
board), metrics, clock, and the services the app builds around them. Routes take it as a
dependency (``Ctx``); the fast path and background tasks are handed it."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Annotated

from fastapi import Depends, Request

from metaserver.access.gate import Access
from metaserver.access.principal import Principal
from metaserver.ascend.pool import DecodeEndpoints
from metaserver.backend import Backend
from metaserver.bindings.feeds import FeedHub
from metaserver.config import MetaserverSettings
from metaserver.kvindex.index import KVIndex
from metaserver.kvindex.streams import Streams
from metaserver.load.board import LoadBoard
from metaserver.metrics import Metrics
from metaserver.store.base import Store

if TYPE_CHECKING:  # needs pyzmq (the kv-routing extra): imported by the app only with --kv-events
    from metaserver.kvindex.manager import KVEventManager


@dataclass
class Context:
    settings: MetaserverSettings
    backend: Backend
    metrics: Metrics
    clock: Callable[[], float]
    ascend: DecodeEndpoints | None = None  # the vllm-ascend decode pool (metaserver.ascend)
    feeds: FeedHub | None = None  # binding feeds (metaserver.bindings.feeds)
    kv_events: KVEventManager | None = None  # --kv-events: engines followed (metaserver.kvindex)

    access: Access | None = None  # built from the settings when not given
    kv_streams: Streams = field(init=False)  # the instances the KV index answers about

    def __post_init__(self) -> None:
        self.kv_streams = Streams(self.store)
        if self.access is None:
            s = self.settings
            token = None if s.token is None else s.token.get_secret_value()
            self.access = Access.load(token, s.credentials_file, s.protect_reads, s.kube_reviewer)

    @property
    def store(self) -> Store:
        return self.backend.store

    @property
    def kv_index(self) -> KVIndex:
        return self.backend.kv_index

    @property
    def load_board(self) -> LoadBoard:
        return self.backend.load_board

    async def authorize(self, header: str | bytes | None, *, write: bool) -> Principal:
        """The caller (``metaserver.access``) from the request's Authorization header: 401
        without a known token where one is needed, 403 for a reader's write."""
        assert self.access is not None
        return await self.access.resolve(header, write=write)


def ctx(request: Request) -> Context:
    context: Context = request.app.state.ctx
    return context


# the app's context, as a FastAPI dependency
Ctx = Annotated[Context, Depends(ctx)]
