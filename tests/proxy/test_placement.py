"""Where requests land: both pools spread under a burst, P's load counted from the moment it is
picked, prefix affinity across requests that share a prompt head."""

from __future__ import annotations

import asyncio

import httpx

from tests.proxy.conftest import Cluster, ProxyFactory, wait_until
from tests.proxy.test_flows import PROMPT


def two_by_two(cluster: Cluster) -> dict[str, list[str]]:
    return {
        "prefill": [p.url for p in cluster.prefill],
        "decode": [d.url for d in cluster.decode],
    }


async def test_placement_burst_uses_every_prefill_and_decode(
    cluster: Cluster, proxy_factory: ProxyFactory
) -> None:
    for fake in cluster.fakes():
        fake.configure(prefill_delay_ms=50)
    proxy = await proxy_factory(**two_by_two(cluster))
    client = proxy.client()
    await asyncio.gather(
        *(
            client.completions.create(model="fake-model", prompt=f"{i} {PROMPT}", max_tokens=2)
            for i in range(8)
        )
    )
    per_p = [len(p.requests()) for p in cluster.prefill]
    per_d = [len(d.requests()) for d in cluster.decode]
    assert per_p == [4, 4], per_p
    assert per_d == [4, 4], per_d


async def test_placement_idle_pools_alternate_for_sequential_requests(
    cluster: Cluster, proxy_factory: ProxyFactory
) -> None:
    proxy = await proxy_factory(**two_by_two(cluster))
    client = proxy.client()
    for i in range(4):
        await client.completions.create(model="fake-model", prompt=f"{i} {PROMPT}", max_tokens=2)
    assert [len(p.requests()) for p in cluster.prefill] == [2, 2]
    assert [len(d.requests()) for d in cluster.decode] == [2, 2]


async def test_placement_prefill_load_counts_from_the_pick(
    cluster: Cluster, proxy_factory: ProxyFactory
) -> None:
    """While the proxy still waits for D's binding, the P it chose already carries the request,
    so requests arriving meanwhile see it as busy."""
    cluster.decode[0].configure(write_binding=False)
    proxy = await proxy_factory(binding_wait_s=30, retries=0)
    p0 = next(i for i in proxy.runtime.registry.instances() if i.url == cluster.prefill[0].url)
    body = {"model": "fake-model", "prompt": PROMPT, "max_tokens": 2}

    async def go() -> None:
        async with httpx.AsyncClient(timeout=60) as http:
            await http.post(proxy.url + "/v1/completions", json=body)

    task = asyncio.ensure_future(go())
    try:
        await wait_until(lambda: len(cluster.decode[0].requests()) == 1)
        await wait_until(lambda: p0.inflight == 1 and p0.tokens > 0)
        assert cluster.prefill[0].requests() == []  # P has not been sent anything yet
    finally:
        task.cancel()
    await wait_until(lambda: p0.inflight == 0 and p0.tokens == 0)


async def test_placement_prefix_policy_keeps_shared_heads_on_one_decode(
    cluster: Cluster, proxy_factory: ProxyFactory
) -> None:
    proxy = await proxy_factory(**two_by_two(cluster), decode_policy="prefix")
    client = proxy.client()
    head = "shared system prompt. " * 40
    for i in range(4):
        await client.completions.create(model="fake-model", prompt=f"{head} q{i}", max_tokens=2)
    per_d = sorted(len(d.requests()) for d in cluster.decode)
    assert per_d == [0, 4], per_d
