"""P's block ids per request, followed from each ``SchedulerOutput``.

vLLM before 0.32 never hands a connector its ``KVCacheManager`` (``bind_kv_cache_manager``), so
the prefill side cannot ask it which blocks a request holds. The scheduler output says it
instead: a new request arrives with all its blocks, a running one with the blocks added this
step, a resumed one (after preemption) with its blocks anew; finished and preempted requests
leave. One KV-cache group (what the connector supports on those versions).
"""

from __future__ import annotations

from typing import Any


class BlockTracker:
    def __init__(self) -> None:
        self._blocks: dict[str, list[int]] = {}

    def update(self, out: Any) -> None:
        for req_id in (
            *(out.finished_req_ids or ()),
            *(getattr(out, "preempted_req_ids", ()) or ()),
        ):
            self._blocks.pop(req_id, None)
        for new in out.scheduled_new_reqs:
            self._blocks[new.req_id] = list(new.block_ids[0]) if new.block_ids else []
        cached = out.scheduled_cached_reqs
        resumed = set(getattr(cached, "resumed_req_ids", ()) or ())
        for i, req_id in enumerate(cached.req_ids):
            added = cached.new_block_ids[i]
            if req_id in resumed:
                self._blocks[req_id] = list(added[0]) if added else []
            elif added:
                self._blocks.setdefault(req_id, []).extend(added[0])

    def get_block_ids(self, req_id: str) -> tuple[list[int], ...]:
        return (self._blocks.get(req_id, []),)
