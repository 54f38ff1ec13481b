"""D: how long a request whose remote KV is all there waits for its first step.

Between P's last done signal reaching D's worker and the request's first forward on D lie the
worker's next poll (``get_transfer_results`` runs once per engine step), the hand-over to the
scheduler (``finished_recving``), vLLM's pause after a step that ran no model (1 ms in vLLM
0.32's engine loop, so transfer threads get the GIL) and, on a busy D, the rest of the step in
progress. The workers report each load's ready time (wall clock, ``PdgateWorkerMetadata.ready``);
this times from there to the ``SchedulerOutput`` that first schedules the request, and
observes ``kv_ready_wait_seconds``. No vLLM import: tested without an engine.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Mapping

from connector.stats import StatsCollector

KEY = "kv_ready_wait_seconds"


class ReadyWait:
    def __init__(
        self,
        stats: StatsCollector,
        wall: Callable[[], float] = time.time,
        max_pending: int = 65_536,
    ) -> None:
        self._stats = stats
        self._wall = wall
        self._max = max_pending
        self._ready: dict[str, float] = {}  # req id -> ready time, in the order they came

    def __bool__(self) -> bool:
        return bool(self._ready)

    def ready(self, at: Mapping[str, float]) -> None:
        """The workers' loads that ended intact this step."""
        self._ready.update(at)
        while len(self._ready) > self._max:  # a request vLLM never scheduled nor finished
            del self._ready[next(iter(self._ready))]

    def scheduled(self, req_ids: Iterable[str]) -> None:
        """A step's newly scheduled requests: those that were waiting for their KV observe how
        long they waited since it was all there."""
        now = self._wall()
        for req_id in req_ids:
            at = self._ready.pop(req_id, None)
            if at is not None:
                self._stats.observe(KEY, max(0.0, now - at))

    def forget(self, req_id: str) -> None:
        """The request finished (aborted) before it was scheduled."""
        self._ready.pop(req_id, None)
