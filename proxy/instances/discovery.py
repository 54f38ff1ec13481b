"""Pluggable instance discovery: each source answers ``poll()`` with the URLs of both pools.

* ``StaticDiscovery``: the ``--prefill`` / ``--decode`` lists;
* ``MetaserverDiscovery``: instances that registered themselves (heartbeat TTL) in the
  metaserver registry — role ``both`` joins both pools;
* ``DnsDiscovery``: Kubernetes headless Services, ``NAME:PORT`` re-resolved every period.
"""

from __future__ import annotations

import asyncio
import logging
import socket
from collections.abc import Awaitable, Callable
from typing import Protocol

from pdwire.client import AsyncMetaserverClient
from proxy.instances.instance import Role
from proxy.instances.registry import Registry

log = logging.getLogger("pdgate.proxy.discovery")
Pools = dict[Role, list[str]]


class DiscoverySource(Protocol):
    async def poll(self) -> Pools: ...


class StaticDiscovery:
    def __init__(self, prefill: list[str], decode: list[str]) -> None:
        self._pools = {Role.PREFILL: list(prefill), Role.DECODE: list(decode)}

    async def poll(self) -> Pools:
        return self._pools


class MetaserverDiscovery:
    def __init__(self, client: AsyncMetaserverClient) -> None:
        self._client = client

    async def poll(self) -> Pools:
        pools: Pools = {Role.PREFILL: [], Role.DECODE: []}
        for inst in await self._client.list_instances():
            if inst.role.value in ("prefill", "both"):
                pools[Role.PREFILL].append(inst.url)
            if inst.role.value in ("decode", "both"):
                pools[Role.DECODE].append(inst.url)
        return pools


Resolver = Callable[[str, int], Awaitable[list[str]]]


async def resolve_host(name: str, port: int) -> list[str]:
    infos = await asyncio.get_running_loop().getaddrinfo(
        name, port, type=socket.SOCK_STREAM, proto=socket.IPPROTO_TCP
    )
    return sorted({str(info[4][0]) for info in infos})


def parse_target(target: str) -> tuple[str, int]:
    name, sep, port = target.rpartition(":")
    if not sep or not name or not port.isdigit():
        raise ValueError(f"{target!r} is not NAME:PORT")
    return name, int(port)


class DnsDiscovery:
    def __init__(self, prefill: str, decode: str, resolver: Resolver = resolve_host) -> None:
        self._targets = {Role.PREFILL: parse_target(prefill), Role.DECODE: parse_target(decode)}
        self._resolve = resolver

    async def poll(self) -> Pools:
        pools: Pools = {}
        for role, (name, port) in self._targets.items():
            addrs = await self._resolve(name, port)
            pools[role] = [
                f"http://[{a}]:{port}" if ":" in a else f"http://{a}:{port}" for a in addrs
            ]
        return pools


async def refresh(source: DiscoverySource, registry: Registry) -> None:
    pools = await source.poll()
    for role, urls in pools.items():
        registry.reconcile(role, urls)


async def run_discovery(source: DiscoverySource, registry: Registry, interval_s: float) -> None:
    """Poll forever; a failed poll keeps the last known pools (and is logged)."""
    while True:
        await asyncio.sleep(interval_s)
        try:
            await refresh(source, registry)
        except Exception as exc:
            log.warning("discovery poll failed, keeping the last pools: %s", exc)
