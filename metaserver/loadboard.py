"""Proxy replicas' shared load: each reports its in-flight requests and tokens per instance
(its open circuits, and each instance's recent prefill work) every fraction of a second, and
reads back the sum of the others'.

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
    recent: dict[str, int] = {}
    for who, r in reports.items():
        if who == replica:
            continue
        for url, (n, tokens) in r.instances.items():
            acc = others.setdefault(url, [0, 0])
            acc[0] += n
            acc[1] += tokens
        open_.update(r.open_circuits)
        for url, work in r.recent.items():
            recent[url] = recent.get(url, 0) + work
    view = {url: (v[0], v[1]) for url, v in others.items()}
    return LoadView(others=view, open_circuits=sorted(open_), recent=recent, replicas=len(reports))


class LoadBoard(abc.ABC):
    @abc.abstractmethod
    async def report(self, replica: str, report: LoadReport) -> LoadView:
        """Record ``replica``'s report; the others' (those not expired), summed."""

    @abc.abstractmethod
    async def view(self, replica: str) -> LoadView:
        """The others' reports (those not expired), summed; records nothing (on Redis, a
        script that only reads)."""


class MemoryLoadBoard(LoadBoard):
    def __init__(self, clock: Callable[[], float]) -> None:
        self._clock = clock
        self._reports: dict[str, tuple[float, LoadReport]] = {}

    async def report(self, replica: str, report: LoadReport) -> LoadView:
        self._reports[replica] = (self._clock() + report.ttl_s, report)
        return await self.view(replica)

    async def view(self, replica: str) -> LoadView:
        now = self._clock()
        live = {}
        for who, (expires, r) in list(self._reports.items()):
            if expires < now:
                del self._reports[who]
            else:
                live[who] = r
        return _sum(replica, live)


# KEYS: the replica's report, the set of replicas; ARGV: its JSON, its ttl in ms, the key prefix
# of reports. One round trip: store the report, read every live one, forget the lapsed.
_REPORT = """
redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
redis.call('SADD', KEYS[2], KEYS[1]:sub(#ARGV[3] + 1))
local out = {}
for _, name in ipairs(redis.call('SMEMBERS', KEYS[2])) do
  local raw = redis.call('GET', ARGV[3] .. name)
  if raw then
    out[#out + 1] = name
    out[#out + 1] = raw
  else
    redis.call('SREM', KEYS[2], name)
  end
end
return out
"""

# KEYS: the set of replicas; ARGV: the key prefix of reports. Reads only: with
# ``appendfsync always`` a write waits for the disk, a read does not.
_VIEW = """
local out = {}
for _, name in ipairs(redis.call('SMEMBERS', KEYS[1])) do
  local raw = redis.call('GET', ARGV[1] .. name)
  if raw then
    out[#out + 1] = name
    out[#out + 1] = raw
  end
end
return out
"""


class RedisLoadBoard(LoadBoard):
    def __init__(self, r: aioredis.Redis, namespace: str) -> None:
        self._r = r
        self._ns = namespace
        self._prefix = f"{namespace}:load:"
        self._replicas = f"{namespace}:loads"
        self._report = r.register_script(_REPORT)
        self._view = r.register_script(_VIEW)

    async def report(self, replica: str, report: LoadReport) -> LoadView:
        keys = [self._prefix + replica, self._replicas]
        args: list[str | int] = [report.model_dump_json(), int(report.ttl_s * 1000), self._prefix]
        try:
            flat = await self._report(keys=keys, args=args)
        except RedisError as exc:
            raise StoreUnavailable(f"load board: {exc}") from exc
        return self._summed(replica, flat)

    async def view(self, replica: str) -> LoadView:
        try:
            flat = await self._view(keys=[self._replicas], args=[self._prefix])
        except RedisError as exc:
            raise StoreUnavailable(f"load board: {exc}") from exc
        return self._summed(replica, flat)

    @staticmethod
    def _summed(replica: str, flat: list[bytes | str]) -> LoadView:
        live: dict[str, LoadReport] = {}
        for name, raw in zip(flat[::2], flat[1::2], strict=True):
            who = name.decode() if isinstance(name, bytes) else str(name)
            live[who] = LoadReport.model_validate(json.loads(raw))
        return _sum(replica, live)
