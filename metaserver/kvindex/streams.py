"""The instances the KV index answers about: those registered with a KV-event stream.

``POST /v1/kv/match`` and ``/v1/kv/placed`` take instance ids from the request; looking up, or
keeping placements for, ids nobody registered only costs (a made-up id a Redis lookup, a memory
index entry for good). The registry is read at most every ``REFRESH_S``: an engine that has just
registered is matched a second later at the latest, which routing hints tolerate.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from metaserver.store.base import Store

REFRESH_S = 1.0


class Streams:
    def __init__(self, store: Store, clock: Callable[[], float] = time.monotonic) -> None:
        self._store = store
        self._clock = clock
        self._ids: frozenset[str] = frozenset()
        self._read_at = float("-inf")

    async def ids(self) -> frozenset[str]:
        now = self._clock()
        if now - self._read_at >= REFRESH_S:
            records = await self._store.list_instances(None)
            # kv_events is stored only when sent (models.LATER_FIELDS): its key says it all
            self._ids = frozenset(r.instance_id for r in records if b'"kv_events"' in r.spec_json)
            self._read_at = now
        return self._ids
