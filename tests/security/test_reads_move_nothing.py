"""A read moves nothing. ``GET /v1/breakdown?ttft_p90=…`` computed the P:D advice for the
caller's target and wrote it into ``pdgate_metaserver_pool_recommended``, the gauge
docs/kubernetes.md feeds to an autoscaler: anyone allowed to read (before: anyone) could scale the
fleet up to its maximum (GPU cost) or hold P down, calling it faster than the 15 s refresh. Now
only the metaserver's own refresh, for its configured targets, writes the gauges."""

from __future__ import annotations

import re
from typing import Any

import httpx

from metaserver import MetaserverSettings, create_app
from metaserver.backend import memory_backend
from metaserver.capacity.advisor import refresh_once
from metaserver.context import Context
from metaserver.store import MemoryStore
from tests.metaserver.conftest import at, decode_instance
from tests.metaserver.test_breakdown import Clock, Ms, transfer

TOKEN = "reads-token-0123456789"
AUTH = {"authorization": f"Bearer {TOKEN}"}


def _gauges(metrics: str) -> dict[str, float]:
    found = re.findall(r'pdgate_metaserver_pool_recommended\{pool="(\w+)"\} ([\d.]+)', metrics)
    return {pool: float(value) for pool, value in found}


async def test_a_breakdown_with_a_target_leaves_the_autoscaling_gauges_alone() -> None:
    clock = Clock()
    store = MemoryStore(binding_ttl_s=3600, retain_s=3600)
    app = create_app(
        MetaserverSettings(token=TOKEN), backend=memory_backend(store), clock=clock
    )  # no target
    transport = httpx.ASGITransport(app)
    async with httpx.AsyncClient(transport=transport, base_url="http://ms", headers=AUTH) as c:
        for role in ("decode", "prefill"):
            for n in range(3):
                spec = decode_instance(role=role, **at(f"{role}-{n}")).model_dump(mode="json")
                assert (await c.put(f"/v1/instances/{role}-{n}", json=spec)).is_success
        ms = Ms(c, clock)
        for i in range(6):
            await transfer(ms, f"t{i}")
        # no target configured: no gauge to feed an autoscaler, whatever readers ask
        for target in ("0.001", "3000"):
            asked = await c.get("/v1/breakdown", params={"ttft_p90": target})
            assert asked.status_code == 200
            assert asked.json()["advice"]["recommended"] == {"prefill": 1, "decode": 3}
        assert _gauges((await c.get("/metrics")).text) == {}
        # with a target, the refresh sets them, and a reader's own target moves nothing
        context: Context = app.state.ctx
        context.settings = context.settings.model_copy(update={"ttft_target_p90_s": 30.0})
        await refresh_once(context)  # what the refresh task does every interval
        before = _gauges((await c.get("/metrics")).text)
        assert before == {"prefill": 1.0, "decode": 3.0}  # one P meets it; D is not judged
        for target in ("0.001", "3000"):
            assert (await c.get("/v1/breakdown", params={"ttft_p90": target})).is_success
        assert _gauges((await c.get("/metrics")).text) == before


class CountingStore(MemoryStore):
    def __init__(self) -> None:
        super().__init__(binding_ttl_s=60, retain_s=60)
        self.scans = 0

    async def open_transfers(self, scan_limit: int) -> Any:
        self.scans += 1
        return await super().open_transfers(scan_limit)


async def test_metrics_scans_the_bindings_at_most_every_interval() -> None:
    """``/metrics`` answers anyone (scrapers carry no token) and scanned up to 10,000 bindings
    per call (security_review_2 M3): a scrape loop was a free store scan. Now one scan per
    ``--metrics-scan-interval`` (5 s), however often it is read."""
    store = CountingStore()
    app = create_app(MetaserverSettings(token=TOKEN), backend=memory_backend(store))
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url="http://ms") as c:
        for _ in range(50):
            assert (await c.get("/metrics")).status_code == 200
    assert store.scans == 1
