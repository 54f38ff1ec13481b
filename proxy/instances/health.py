"""Active health probes: ``GET <url>/health`` on every instance, every ``interval_s``.

``unhealthy_after`` failed probes in a row take an instance out of selection; one good probe
brings it back. Passive ejection (errors on real requests) is the circuit breaker's job.
"""

from __future__ import annotations

import asyncio
import logging

import aiohttp

from proxy.instances.instance import Instance
from proxy.instances.registry import Registry

log = logging.getLogger("pdgate.proxy.health")


class HealthChecker:
    def __init__(
        self,
        registry: Registry,
        session: aiohttp.ClientSession,
        *,
        interval_s: float = 5.0,
        timeout_s: float = 2.0,
        unhealthy_after: int = 2,
    ) -> None:
        self._registry = registry
        self._session = session
        self._interval = interval_s
        self._timeout = aiohttp.ClientTimeout(total=timeout_s)
        self._unhealthy_after = unhealthy_after
        self._misses: dict[str, int] = {}

    async def probe(self, inst: Instance) -> bool:
        """True when healthy; a failure records whether it was only slow (a timeout)."""
        try:
            async with self._session.get(inst.url + "/health", timeout=self._timeout) as resp:
                await resp.read()
                inst.slow = False
                return resp.status == 200
        except TimeoutError:
            inst.slow = True
            return False
        except aiohttp.ClientError:
            inst.slow = False
            return False

    async def check_all(self) -> None:
        instances = self._registry.instances()
        results = await asyncio.gather(*(self.probe(i) for i in instances))
        for inst, ok in zip(instances, results, strict=True):
            key = f"{inst.role}:{inst.url}"
            if ok:
                self._misses.pop(key, None)
                if not inst.healthy:
                    log.info("%s %s healthy again", inst.role.value, inst.url)
                inst.healthy = True
                continue
            misses = self._misses.get(key, 0) + 1
            self._misses[key] = misses
            if misses >= self._unhealthy_after and inst.healthy:
                log.warning("%s %s failed %d health probes", inst.role.value, inst.url, misses)
                inst.healthy = False
        self._registry.sweep()

    async def run(self) -> None:
        while True:
            try:
                await self.check_all()
            except Exception:  # a probe round must never kill the loop
                log.exception("health probe round failed")
            await asyncio.sleep(self._interval)
