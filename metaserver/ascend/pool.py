"""The vllm-ascend decode pool: ``--ascend-decode HOST:PORT[-PORT]`` entries (``PoolEntry``), HOST
an address or a DNS name re-resolved every few seconds, plus (unless ``--no-ascend-registry``)
the KV endpoints of registered decode instances. ``DecodeEndpoints.problem`` says whether a
binding's ``remote_host:remote_port`` belongs to it."""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import re
import socket
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass

from metaserver.store.base import Store
from pdwire.models import InstanceSpec

log = logging.getLogger("pdgate.metaserver.ascend")
_HOST = re.compile(r"[A-Za-z0-9._:-]{1,255}")
Resolver = Callable[[str], Awaitable[list[str]]]


@dataclass(frozen=True, slots=True)
class PoolEntry:
    host: str
    first_port: int
    last_port: int

    @classmethod
    def parse(cls, text: str) -> PoolEntry:
        host, sep, ports = text.strip().rpartition(":")
        host = host.strip("[]")
        first, _, last = ports.partition("-")
        bad_host = not host or not _HOST.fullmatch(host)
        if not sep or bad_host or not first.isdigit() or (last and not last.isdigit()):
            raise ValueError(f"{text!r}: expected HOST:PORT or HOST:PORT-PORT")
        lo, hi = int(first), int(last or first)
        if not 1 <= lo <= hi <= 65535:
            raise ValueError(f"{text!r}: ports must satisfy 1 <= first <= last <= 65535")
        return cls(host, lo, hi)


def _is_address(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


async def resolve_host(name: str) -> list[str]:
    infos = await asyncio.get_running_loop().getaddrinfo(name, None, type=socket.SOCK_STREAM)
    return sorted({str(info[4][0]) for info in infos})


class DecodeEndpoints:
    """Whether ``host:port`` belongs to the decode pool; lookups refreshed every ``refresh_s``."""

    def __init__(
        self,
        entries: Sequence[str],
        store: Store,
        *,
        use_registry: bool = True,
        refresh_s: float = 5.0,
        resolve: Resolver = resolve_host,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._entries = [PoolEntry.parse(e) for e in entries]
        self._store = store
        self._use_registry = use_registry
        self._refresh_s = refresh_s
        self._resolve = resolve
        self._clock = clock
        self._addresses: dict[str, list[str]] = {}  # entry host → its addresses
        self._registered: set[tuple[str, int]] = set()
        self._next_dns = self._next_registry = 0.0
        self._lock = asyncio.Lock()

    @property
    def configured(self) -> bool:
        return bool(self._entries) or self._use_registry

    async def problem(self, host: str, port: int) -> str | None:
        """``None`` when the pool holds ``host:port``; else why the binding is refused."""
        host = host.strip("[]")
        if self._static_match(host, port):
            return None
        await self._refresh()
        if self._static_match(host, port) or (host, port) in self._registered:
            return None
        if not self.configured:
            return "no decode pool is configured (--ascend-decode): every binding is refused"
        return f"{host}:{port} is not a KV endpoint of a known decode instance"

    def _static_match(self, host: str, port: int) -> bool:
        for e in self._entries:
            if e.first_port <= port <= e.last_port:
                if host == e.host or host in self._addresses.get(e.host, ()):
                    return True
        return False

    async def _refresh(self) -> None:
        now = self._clock()
        if now < self._next_dns and (not self._use_registry or now < self._next_registry):
            return
        async with self._lock:
            now = self._clock()
            if now >= self._next_dns:
                self._next_dns = now + self._refresh_s
                await self._refresh_dns()
            if self._use_registry and now >= self._next_registry:
                self._next_registry = now + self._refresh_s
                await self._refresh_registry()

    async def _refresh_dns(self) -> None:
        for name in {e.host for e in self._entries if not _is_address(e.host)}:
            try:
                self._addresses[name] = await self._resolve(name)
            except OSError as exc:  # keep what the last lookup found
                log.warning("decode pool: cannot resolve %s: %s", name, exc)

    async def _refresh_registry(self) -> None:
        found: set[tuple[str, int]] = set()
        for role in ("decode", "both"):
            for inst in await self._store.list_instances(role):
                kv = InstanceSpec.model_validate_json(inst.spec_json).kv_endpoint
                if kv is not None:
                    found.add((kv.host, kv.port))
        self._registered = found
