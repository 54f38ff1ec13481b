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
after the choice for a long prompt. So the policy also remembers, for ``memory_s``
(``--kv-memory``, ``PENDING_S`` by default), where it chose to send each prompt's blocks (at
most ``MAX_PENDING`` keys, oldest dropped) and counts them as held there; the index's own count
wins where larger. A choice is remembered as it is made, so the requests of a burst that share
a prefix follow the first of them. A choice whose attempt fails is remembered all the same (for
``memory_s`` at most). This memory is the replica's own; the dispatcher also places the choice
in the index (``KVLookup.placed``), which is how the other replicas learn it.
"""

from __future__ import annotations

import hashlib
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import replace

from proxy.instances import Instance, Role
from proxy.policies.base import RequestInfo
from proxy.policies.least_load import LeastLoad

RECOMPUTE_WEIGHT = 2
PENDING_S = 10.0
MAX_PENDING = 200_000


class KVAware:
    name = "kv"

    def __init__(
        self,
        slack: int = 2,
        clock: Callable[[], float] = time.monotonic,
        *,
        memory_s: float = PENDING_S,
    ) -> None:
        self._slack = slack
        self._memory_s = memory_s
        self._fallback = LeastLoad()
        self._clock = clock
        self._pending: OrderedDict[int, tuple[str, float]] = OrderedDict()  # key: (url, until)

    def choose(self, candidates: Sequence[Instance], req: RequestInfo) -> Instance:
        kv = req.kv
        if kv is None or len(candidates) == 1:
            return self._fallback.choose(candidates, req)
        now = self._clock()
        self._add_pending(candidates, req, now)
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
        self._remember(chosen, req, now)
        return chosen

    def on_routed(self, inst: Instance, req: RequestInfo) -> None:
        pass  # remembered when chosen

    def _remember(self, inst: Instance, req: RequestInfo, now: float) -> None:
        assert req.kv is not None
        m = req.kv.get(inst.url)
        if m is None or not m.keys:
            return
        until = now + self._memory_s
        pending = self._pending
        for key in m.keys:
            pending[key] = (inst.url, until)
            pending.move_to_end(key)
        while len(pending) > MAX_PENDING:
            pending.popitem(last=False)

    def _add_pending(self, candidates: Sequence[Instance], req: RequestInfo, now: float) -> None:
        """Count the blocks this policy sent to a candidate lately as held there."""
        assert req.kv is not None
        for c in candidates:
            m = req.kv.get(c.url)
            if m is None or not m.keys:
                continue
            n = 0
            for key in m.keys:
                sent = self._pending.get(key)
                if sent is None or sent[0] != c.url or sent[1] < now:
                    break
                n += 1
            if n > m.blocks:
                req.kv[c.url] = replace(m, blocks=n, tokens=n * m.block_size)


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
