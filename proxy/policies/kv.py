"""kv: choose on the engines' real prefix caches (``proxy.kvroute``; ``least_load`` without).

Prefill: the smallest ``uncached tokens in flight + RECOMPUTE_WEIGHT x this prompt's uncached
tokens``. The in-flight tokens are roughly what this prompt waits behind (chunked prefill
batches the rest with it); its own uncached tokens count twice, once for its wait and once for
the capacity a recomputed prefix takes from every later request. So a prefix hit wins until
the instance holding it is busier than twice the compute it saves. Decode: among the
instances within ``slack`` requests of the least loaded, the one holding most of the prompt
(its hits are blocks P does not push); decode load matters first, for every stream's ITL.
"""

from __future__ import annotations

from collections.abc import Sequence

from proxy.instances import Instance, Role
from proxy.policies.base import RequestInfo
from proxy.policies.least_load import LeastLoad

RECOMPUTE_WEIGHT = 2


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
            least = min(c.load[0] for c in candidates)
            near = [c for c in candidates if c.load[0] <= least + self._slack]
            return max(near, key=lambda c: (_held(req, c), -c.load[0], -c.load[1]))
        return min(
            candidates,
            key=lambda c: (c.load[1] + RECOMPUTE_WEIGHT * req.uncached(c), c.load[0]),
        )

    def on_routed(self, inst: Instance, req: RequestInfo) -> None:
        return None


def _held(req: RequestInfo, inst: Instance) -> int:
    assert req.kv is not None
    m = req.kv.get(inst.url)
    return 0 if m is None else m.blocks
