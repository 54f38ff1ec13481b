"""Proxy replicas' shared load: each reports its in-flight requests and tokens per instance
(and its open circuits) every fraction of a second, and reads back the sum of the others'.

A report replaces the replica's previous one and lapses after its ``ttl_s``, so a replica that
stops reporting stops counting; reports are absolute (not deltas), so a lost one costs nothing
but staleness. In memory for one metaserver process, in Redis (``<ns>:load:<replica>`` with
Redis's own expiry, ``<ns>:loads`` listing them) for replicas of the metaserver.
"""

from __future__ import annotations

import abc
import json
from collections.abc import Callable

import redis.asyncio as aioredis
from redis.exceptions import RedisError

from metaserver.errors import StoreUnavailable
from pdwire.models import LoadReport, LoadView


def _sum(replica: str, reports: dict[str, LoadReport]) -> LoadView:
    others: dict[str, list[int]] = {}
    open_: set[str] = set()
    for who, r in reports.items():
        if who == replica:
            continue
        for url, (n, tokens) in r.instances.items():
            acc = others.setdefault(url, [0, 0])
            acc[0] += n
            acc[1] += tokens
        open_.update(r.open_circuits)
    view = {url: (v[0], v[1]) for url, v in others.items()}
    return LoadView(others=view, open_circuits=sorted(open_), replicas=len(reports))


class LoadBoard(abc.ABC):
    @abc.abstractmethod
    async def report(self, replica: str, report: LoadReport) -> LoadView:
        """Record ``replica``'s report; the others' (those not expired), summed."""


class MemoryLoadBoard(LoadBoard):
    def __init__(self, clock: Callable[[], float]) -> None:
        self._clock = clock
        self._reports: dict[str, tuple[float, LoadReport]] = {}

    async def report(self, replica: str, report: LoadReport) -> LoadView:
        now = self._clock()
        self._reports[replica] = (now + report.ttl_s, report)
        live = {}
        for who, (expires, r) in list(self._reports.items()):
            if expires < now:
                del self._reports[who]
            else:
                live[who] = r
        return _sum(replica, live)


class RedisLoadBoard(LoadBoard):
    def __init__(self, r: aioredis.Redis, namespace: str) -> None:
        self._r = r
        self._ns = namespace

    async def report(self, replica: str, report: LoadReport) -> LoadView:
        key = f"{self._ns}:load:{replica}"
        try:
            async with self._r.pipeline(transaction=False) as pipe:
                pipe.set(key, report.model_dump_json(), px=int(report.ttl_s * 1000))
                pipe.sadd(f"{self._ns}:loads", replica)
                pipe.smembers(f"{self._ns}:loads")
                *_, members = await pipe.execute()
            names = sorted(m.decode() if isinstance(m, bytes) else str(m) for m in members)
            values = await self._r.mget([f"{self._ns}:load:{n}" for n in names])
            live: dict[str, LoadReport] = {}
            gone = []
            for name, raw in zip(names, values, strict=True):
                if raw is None:
                    gone.append(name)
                else:
                    live[name] = LoadReport.model_validate(json.loads(raw))
            if gone:
                await self._r.srem(f"{self._ns}:loads", *gone)
        except RedisError as exc:
            raise StoreUnavailable(f"load board: {exc}") from exc
        return _sum(replica, live)
