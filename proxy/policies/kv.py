"""kv: choose on the engines' real prefix caches (``proxy.kvroute``; ``least_load`` without).

Prefill: the smallest ``uncached tokens in flight + RECOMPUTE_WEIGHT x this prompt's uncached
tokens``. The in-flight tokens are roughly what this prompt waits behind (chunked prefill
batches the rest with it); its own uncached tokens count twice, once for its wait and once for
the capacity a recomputed prefix takes from every later request. So a prefix hit wins until
the instance holding it is busier than twice the compute it saves. Ties (a prompt no P holds,
every P idle: common, as a P's load ends with its leg) go to the P that computed least lately
(``Instance.work``: uncached tokens this policy sent it, decaying over a minute; with
``--share-load``, every replica's), then by a hash of the prompt and the instance: with
candidate order as the tie-break, the first P took every new prefix and, with it, their later
requests (64 % of the work in the routing bench).
Decode: among the instances within ``slack`` requests of the least loaded, the one holding most
of the prompt (its hits are blocks P does not push); decode load matters first, for every
stream's ITL.

The index learns a block once an engine has computed it and published the event: seconds
after the choice for a long prompt. Until then the blocks count as held where a proxy chose to
send them: each choice is placed in the index (``proxy.routing.kv``), whose matches count it for
``--kv-placed``, and counted here before then (``KVLookup.pending``), so the requests of a burst
that share a prefix follow the first of them. The policy itself keeps no memory.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Callable, Sequence

from proxy.instances import Instance, Role
from proxy.policies.base import RequestInfo
from proxy.policies.least_load import LeastLoad

RECOMPUTE_WEIGHT = 2


class KVAware:
    name = "kv"

    def __init__(self, slack: int = 2, clock: Callable[[], float] = time.monotonic) -> None:
        self._slack = slack
        self._fallback = LeastLoad()
        self._clock = clock

    def choose(self, candidates: Sequence[Instance], req: RequestInfo) -> Instance:
        kv = req.kv
        if kv is None or len(candidates) == 1:
            return self._fallback.choose(candidates, req)
        now = self._clock()
        if candidates[0].role is Role.DECODE:
            least = min(c.load[0] for c in candidates)
            near = [c for c in candidates if c.load[0] <= least + self._slack]
            chosen = max(near, key=lambda c: (_held(req, c), -c.load[0], -c.load[1]))
        else:
            chosen = min(
                candidates,
                key=lambda c: (
                    c.load[1] + RECOMPUTE_WEIGHT * req.uncached(c),
                    c.load[0],
                    c.work.at(now),
                    _spread(req, c),
                ),
            )
            chosen.work.add(req.uncached(chosen), now)
        return chosen

    def on_routed(self, inst: Instance, req: RequestInfo) -> None:
        pass  # placed in the index when chosen (``proxy.routing.kv``)


def _spread(req: RequestInfo, inst: Instance) -> bytes:
    """The last tie-break: a hash of the prompt's first block and the instance (rendezvous
    hashing). Replicas order candidates as discovery found them and decide at the same instant
    before they share what they chose; on this they agree, and new prompts spread."""
    assert req.kv is not None
    m = req.kv.get(inst.url)
    first = m.keys[0] if m is not None and m.keys else 0
    who = (m.instance_id if m is not None and m.instance_id else inst.url).encode()
    return hashlib.blake2b(first.to_bytes(8, "little") + who, digest_size=8).digest()


def _held(req: RequestInfo, inst: Instance) -> int:
    assert req.kv is not None
    m = req.kv.get(inst.url)
    return 0 if m is None else m.blocks
