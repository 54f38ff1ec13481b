"""Instances read from the metaserver registry (fakes register themselves with a TTL)."""

from __future__ import annotations

from pdwire.client import AsyncMetaserverClient
from proxy.instances import MetaserverDiscovery, Role
from tests.proxy.conftest import Cluster, ProxyFactory
from tests.proxy.test_flows import PROMPT


async def test_metaserver_discovery_lists_registered_instances(cluster: Cluster) -> None:
    async with AsyncMetaserverClient(cluster.metaserver.url) as client:
        pools = await MetaserverDiscovery(client).poll()
    assert sorted(pools[Role.DECODE]) == sorted(d.url for d in cluster.decode)
    assert sorted(pools[Role.PREFILL]) == sorted(p.url for p in cluster.prefill)


async def test_proxy_with_metaserver_discovery_serves(
    cluster: Cluster, proxy_factory: ProxyFactory
) -> None:
    proxy = await proxy_factory(discovery="metaserver", prefill=[], decode=[])
    urls = sorted(i.url for i in proxy.runtime.registry.instances())
    assert urls == sorted(f.url for f in cluster.fakes())
    out = await proxy.client().completions.create(model="fake-model", prompt=PROMPT, max_tokens=2)
    assert out.choices[0].text == "tok0 tok1 "
