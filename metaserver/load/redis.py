"""The load board every metaserver replica shares: one Redis key per replica's report, with
Redis's own expiry (scripts: ``load.redis_scripts``)."""

from __future__ import annotations

import json

import redis.asyncio as aioredis
from redis.exceptions import RedisError

from metaserver.errors import StoreUnavailable
from metaserver.load import redis_scripts as lua
from metaserver.load.board import LoadBoard, others_summed
from pdwire.models import LoadReport, LoadView


class RedisLoadBoard(LoadBoard):
    def __init__(self, r: aioredis.Redis, namespace: str) -> None:
        self._r = r
        self._prefix = f"{namespace}:load:"
        self._replicas = f"{namespace}:loads"
        self._report = r.register_script(lua.REPORT)
        self._view = r.register_script(lua.VIEW)

    async def report(self, replica: str, report: LoadReport) -> LoadView:
        keys = [self._prefix + replica, self._replicas]
        args: list[str | int] = [report.model_dump_json(), int(report.ttl_s * 1000), self._prefix]
        try:
            flat = await self._report(keys=keys, args=args)
        except RedisError as exc:
            raise StoreUnavailable(f"load board: {exc}") from exc
        return _summed(replica, flat)

    async def view(self, replica: str) -> LoadView:
        try:
            flat = await self._view(keys=[self._replicas], args=[self._prefix])
        except RedisError as exc:
            raise StoreUnavailable(f"load board: {exc}") from exc
        return _summed(replica, flat)


def _summed(replica: str, flat: list[bytes | str]) -> LoadView:
    """A script's ``name, report, name, report...`` summed for ``replica``."""
    live: dict[str, LoadReport] = {}
    for name, raw in zip(flat[::2], flat[1::2], strict=True):
        who = name.decode() if isinstance(name, bytes) else str(name)
        live[who] = LoadReport.model_validate(json.loads(raw))
    return others_summed(replica, live)
