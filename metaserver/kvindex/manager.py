"""Follow every registered engine that publishes KV events (``--kv-events``).

Every ``interval_s`` the manager reads the registry: an instance whose registration names
``kv_events`` gets a ``Follower`` (on the host of its url: a registration cannot point the
metaserver elsewhere); one that left, or registered anew (a restart), loses its follower and its
entries. With replicas on one Redis, one of them follows (``KVIndex.lead``); the others serve
matches from the shared index and take over when the leader's lease lapses.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
from dataclasses import dataclass
from urllib.parse import urlsplit

import zmq.asyncio

from metaserver.kvindex.follower import Follower, Source
from metaserver.kvindex.index import KVIndex
from metaserver.store import Store, StoredInstance
from pdwire.models import InstanceSpec

log = logging.getLogger("pdgate.metaserver.kvindex")


@dataclass
class _Followed:
    follower: Follower
    task: asyncio.Task[None]
    registered_at: float


def source_of(record: StoredInstance) -> Source | None:
    inst = InstanceSpec.model_validate_json(record.spec_json)
    ev = inst.kv_events
    if ev is None:
        return None
    host = urlsplit(inst.url).hostname
    if not host:
        return None
    host = f"[{host}]" if ":" in host else host
    replay = None if ev.replay_port is None else f"tcp://{host}:{ev.replay_port}"
    return Source(f"tcp://{host}:{ev.port}", replay, ev.topic)


class KVEventManager:
    def __init__(self, store: Store, index: KVIndex, *, interval_s: float = 2.0) -> None:
        self.store = store
        self.index = index
        self.interval_s = interval_s
        self.me = f"{socket.gethostname()}:{os.getpid()}"
        self.leading = False
        self._ctx = zmq.asyncio.Context()
        self._followed: dict[str, _Followed] = {}
        self._unreadable: set[str] = set()

    @property
    def followers(self) -> list[Follower]:
        return [f.follower for f in self._followed.values()]

    async def run(self) -> None:
        try:
            while True:
                try:
                    await self.reconcile()
                except Exception as exc:  # a store outage: try again next round
                    log.warning("KV event followers not reconciled: %s", exc)
                await asyncio.sleep(self.interval_s)
        finally:
            for iid in list(self._followed):
                await self._unfollow(iid, forget=False)
            self._ctx.destroy(linger=0)  # closes any socket left: term() would wait on it

    async def reconcile(self) -> None:
        leading = await self.index.lead(self.me, ttl_s=max(5 * self.interval_s, 10.0))
        if leading != self.leading:
            log.info("KV event index: %s", "following engines" if leading else "standing by")
            self.leading = leading
        if not leading:
            for iid in list(self._followed):
                await self._unfollow(iid, forget=False)
            return
        live: dict[str, StoredInstance] = {}
        for record in await self.store.list_instances(None):
            live[record.instance_id] = record
        for iid, followed in list(self._followed.items()):
            now = live.get(iid)
            if now is None or now.registered_at != followed.registered_at:
                await self._unfollow(iid, forget=True)
            elif followed.task.done():  # ended on an error: start again
                exc = followed.task.exception()
                log.warning("KV events of %s: follower stopped (%r): restarting", iid, exc)
                await self._unfollow(iid, forget=True)
        for iid, record in live.items():
            if iid in self._followed:
                await self.index.touch(iid)
                continue
            try:
                source = source_of(record)
            except ValueError as exc:  # a record this version cannot read: not followed
                if iid not in self._unreadable:  # said once per instance, not every round
                    self._unreadable.add(iid)
                    log.warning("instance %s: its KV events cannot be followed: %s", iid, exc)
                continue
            if source is not None:
                follower = Follower(iid, source, self.index, self._ctx)
                task = asyncio.get_running_loop().create_task(follower.run())
                self._followed[iid] = _Followed(follower, task, record.registered_at)

    async def _unfollow(self, instance_id: str, *, forget: bool) -> None:
        followed = self._followed.pop(instance_id)
        followed.task.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await followed.task
        if forget:
            await self.index.drop(instance_id)
            log.info("KV events of %s no longer followed: its entries dropped", instance_id)
