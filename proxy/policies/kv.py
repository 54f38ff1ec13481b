"""kv: choose on the engines' real prefix caches (``proxy.kvroute``; ``least_load`` without).

Prefill: the smallest ``uncached tokens in flight + this prompt's uncached tokens`` — a prefix
hit saves compute only while the instance is not busier than that saving. Decode: among the
instances within ``slack`` requests of the least loaded, the one holding most of the prompt
(its hits are blocks P does not push); decode load matters first, for every stream's ITL.
"""

from __future__ import annotations

from collections.abc import Sequence

from proxy.instances import Instance, Role
from proxy.policies.base import RequestInfo
from proxy.policies.least_load import LeastLoad


class KVAware:
    name = "kv"

    def __init__(self, slack: int = 2) -> None:
        self._slack = slack
        self._fallback = LeastLoad()

    def choose(self, candidates: Sequence[Instance], req: RequestInfo) -> Instance:
        kv = req.kv
        if kv is None or len(candidates) == 1:
            return self._fallback.choose(candidates, req)
        if candidates[0].role is Role.DECODE:
            least = min(c.inflight for c in candidates)
            near = [c for c in candidates if c.inflight <= least + self._slack]
            return max(near, key=lambda c: (_held(req, c), -c.inflight, -c.tokens))
        return min(candidates, key=lambda c: (c.tokens + req.uncached(c), c.inflight))

    def on_routed(self, inst: Instance, req: RequestInfo) -> None:
        return None


def _held(req: RequestInfo, inst: Instance) -> int:
    assert req.kv is not None
    m = req.kv.get(inst.url)
    return 0 if m is None else m.blocks
