"""Active-active replicas through a real ``pd-metaserver`` on a real redis-server with
``appendfsync always`` (the durability docs/metaserver.md recommends), with the proxy's own
client: one replica's report reaches the other's read (the read writes nothing, so Redis
answers it without its disk: tests/metaserver/test_loadboard.py; what that saves,
tests/bench/share_bench.py)."""

from __future__ import annotations

from collections.abc import Callable

from pdwire.client import AsyncMetaserverClient, RetryPolicy
from proxy.instances import Registry, Role
from proxy.instances.share import LoadShare
from tests.support.services import MetaserverProcess, RedisServer

P = ["http://p0:1", "http://p1:1"]


async def test_one_replicas_report_reaches_the_others_read(
    metaserver_factory: Callable[..., MetaserverProcess], redis_server: RedisServer
) -> None:
    ms = metaserver_factory(redis_server.url, "--namespace", "share-live")
    regs = [Registry(), Registry()]
    for reg in regs:
        reg.reconcile(Role.PREFILL, P)
    clients = [
        AsyncMetaserverClient(ms.url, timeout_s=5.0, retry=RetryPolicy(retries=0)) for _ in regs
    ]
    a, b = (LoadShare(reg, c, name, 0.1) for reg, c, name in zip(regs, clients, "ab", strict=True))
    try:
        for _ in range(3):  # connections open, scripts loaded, both on the board
            await a.once()
            await b.once()
        assert (a.replicas, b.replicas) == (2, 2)
        p0 = next(i for i in regs[0].instances() if i.url == P[0])
        p0.acquire(900)  # a chooses p0
        await a.once()
        await b.look()
        b_p0 = next(i for i in regs[1].instances() if i.url == P[0])
        assert (b_p0.remote_inflight, b_p0.remote_tokens) == (1, 900)
        assert b.replicas == 2 and a.failures == b.failures == 0
    finally:
        for c in clients:
            await c.close()
