"""One quantile for every figure the metaserver serves: nearest rank, a latency that was measured.
``/v1/stats``'s bound→done p50/p90/p99 interpolated between samples before, while
``/v1/breakdown``'s stages (``tests/metaserver/test_breakdown.py``) took the nearest rank: the
same latencies gave two different p90s."""

from __future__ import annotations

import httpx
import pytest

from metaserver import MetaserverSettings, create_app
from metaserver.backend import memory_backend
from metaserver.capacity.quantile import quantile
from metaserver.store import MemoryStore
from tests.metaserver.test_api import register, spec_json
from tests.metaserver.test_breakdown import Clock


def test_quantile_is_the_nearest_rank() -> None:
    values = [10.0, 20.0, 30.0, 40.0]
    assert [quantile(values, q) for q in (0.01, 0.25, 0.5, 0.51, 0.9, 0.99, 1.0)] == [
        10.0, 10.0, 20.0, 30.0, 40.0, 40.0, 40.0,
    ]  # fmt: skip
    assert quantile([7.0], 0.5) == 7.0


@pytest.mark.parametrize(
    ("latencies_ms", "expected"),
    [
        ([10, 20, 30, 40], {"p50": 20.0, "p90": 40.0, "p99": 40.0}),  # interpolated: 25, 37, 39.7
        ([5], {"p50": 5.0, "p90": 5.0, "p99": 5.0}),
        ([], {"p50": None, "p90": None, "p99": None}),
    ],
)
async def test_stats_latencies_are_measured_ones(
    latencies_ms: list[int], expected: dict[str, float | None]
) -> None:
    clock = Clock()
    store = MemoryStore(binding_ttl_s=3600, retain_s=3600)
    app = create_app(MetaserverSettings(), backend=memory_backend(store), clock=clock)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url="http://ms") as api:
        await register(api)
        for i, ms in enumerate(latencies_ms):
            assert (await api.put(f"/v1/bindings/t{i}", json=spec_json())).status_code == 201
            clock.now += ms / 1000
            done = {"state": "done", "actor": "p"}
            assert (await api.post(f"/v1/bindings/t{i}/events", json=done)).status_code == 200
        stats = (await api.get("/v1/stats")).json()
    assert stats["bound_to_done_samples"] == len(latencies_ms)
    got = stats["bound_to_done_ms"]
    assert got.keys() == expected.keys()
    for name, value in expected.items():
        assert got[name] == (None if value is None else pytest.approx(value, abs=1e-3)), name
