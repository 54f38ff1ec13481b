"""Canaries: a greedy one-token request through each P/D pair that no greedy request judged
lately, so that a pair whose KV goes wrong is quarantined even when clients only sample.

Every ``--canary-interval`` seconds each pair of available instances that may be paired (same
KV identity, not quarantined) and whose first tokens were not judged (``proxy.integrity``)
within the interval gets one request through the proxy's flow: a fixed prompt of a few blocks,
``max_tokens`` 1, ``temperature`` 0, no model named (the engine's own). Its first tokens are
judged like a client's; a mismatch quarantines the pair. Canaries run one at a time; each is
counted in ``pd_canaries_total{outcome}``.
"""

from __future__ import annotations

import asyncio
import logging

from pdwire.ids import IdMaker
from proxy.errors import ProxyError
from proxy.flows import Attempt, Flow
from proxy.instances import Instance, Registry, Role
from proxy.integrity import PairGuard, Verdict
from proxy.metrics import Metrics
from proxy.policies import RequestInfo
from proxy.rewrite import ClientRequest
from proxy.routing.pairing import Pairing

log = logging.getLogger("pdgate.proxy.canary")

PROMPT = (
    "A canary of pdgate: this fixed prompt goes through one prefill and one decode instance, "
    "and the first token that each of them samples from it must be the same one. "
) * 3
PATH = "/v1/completions"


class Canaries:
    def __init__(
        self,
        registry: Registry,
        flow: Flow,
        guard: PairGuard,
        pairing: Pairing,
        metrics: Metrics,
        ids: IdMaker,
        interval_s: float,
    ) -> None:
        self._registry = registry
        self._flow = flow
        self._guard = guard
        self._pairing = pairing
        self._ids = ids
        self.interval_s = interval_s
        self._outcomes = {
            name: metrics.canaries.labels(name) for name in (*(v.value for v in Verdict), "error")
        }

    async def run(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            try:
                await self.round()
            except Exception as exc:  # one bad round must not end the canaries
                log.warning("canary round failed: %r", exc)

    async def round(self) -> int:
        """One canary for each pair that needs one; returns how many were sent."""
        sent = 0
        for d in self._registry.available(Role.DECODE):
            for p in self._registry.available(Role.PREFILL):
                if self._due(p, d):
                    await self.probe(p, d)
                    sent += 1
        return sent

    def _due(self, p: Instance, d: Instance) -> bool:
        if not self._pairing.allows(p, d):
            return False
        last = self._guard.last_judged(p, d)
        return last is None or self._guard.now - last[0] >= self.interval_s

    async def probe(self, p: Instance, d: Instance) -> str:
        """Send one canary through ``p`` and ``d``; returns its outcome."""
        body = {"prompt": PROMPT, "max_tokens": 1, "temperature": 0, "stream": False}
        req = ClientRequest(body, chat=False)
        a = Attempt(req, RequestInfo(req.prompt, req.tokens), PATH, d, p, self._ids.next())
        before = self._guard.last_judged(p, d)
        d.acquire(req.tokens)
        p.acquire(req.tokens)
        try:
            up = await self._flow.open(a)
            up.release()
        except ProxyError as exc:
            log.warning("canary %s through %s and %s failed: %s", a.tid, p.url, d.url, exc)
            outcome = "error"
        else:
            after = self._guard.last_judged(p, d)
            outcome = after[1].value if after is not None and after != before else "unjudged"
            log.debug("canary %s through %s and %s: %s", a.tid, p.url, d.url, outcome)
        finally:
            d.release(req.tokens)
            p.release(req.tokens)
        self._outcomes[outcome].inc()
        return outcome
