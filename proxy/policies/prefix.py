"""prefix: cache-aware — send a prompt where its longest prefix was sent before.

Memory is bounded: one LRU map ``block hash → instance url`` of at most ``max_blocks`` entries
(prefix blocks are chained hashes of 256-character pieces, so equal hashes mean equal
prefixes, approximately). A match shorter than ``min_match`` blocks, or an instance loaded more
than ``balance`` requests above the least loaded one, falls back to least load.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from proxy.instances import Instance
from proxy.policies.base import RequestInfo
from proxy.policies.least_load import LeastLoad


class PrefixAware:
    name = "prefix"

    def __init__(self, max_blocks: int = 200_000, min_match: int = 1, balance: int = 32) -> None:
        self._owner: OrderedDict[int, str] = OrderedDict()
        self._max = max_blocks
        self._min_match = min_match
        self._balance = balance
        self._fallback = LeastLoad()  # rotates among idle ties, like the default policy

    def __len__(self) -> int:
        return len(self._owner)

    def matched_blocks(self, inst: Instance, req: RequestInfo) -> int:
        n = 0
        for h in req.hashes:
            if self._owner.get(h) != inst.url:
                break
            n += 1
        return n

    def choose(self, candidates: Sequence[Instance], req: RequestInfo) -> Instance:
        least = self._fallback.choose(candidates, req)
        if not req.hashes:
            return least
        by_url = {c.url: c for c in candidates}
        best: Instance | None = None
        depth = 0
        for h in req.hashes:
            url = self._owner.get(h)
            inst = by_url.get(url) if url is not None else None
            if inst is None:
                break
            best, depth = inst, depth + 1
        if best is None or depth < self._min_match:
            return least
        if best.load[0] - least.load[0] > self._balance:
            return least
        return best

    def on_routed(self, inst: Instance, req: RequestInfo) -> None:
        owner = self._owner
        for h in req.hashes:
            owner[h] = inst.url
            owner.move_to_end(h)
        while len(owner) > self._max:
            owner.popitem(last=False)
