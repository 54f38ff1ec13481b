"""Fixtures: each backend (store, KV index and load board: memory, Redis, Sentinel), and the app
served in-process over ASGI."""

from __future__ import annotations

import asyncio
import itertools
import time
import zlib
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from metaserver import MetaserverSettings, create_app
from metaserver.backend import Backend, memory_backend, redis_backend
from metaserver.store import MemoryStore, Store
from pdwire.models import BindingSpec, InstanceSpec, KVEndpoint
from tests.support.clock import FakeClock
from tests.support.services import RedisServer

_ns = itertools.count()
STORES = ["memory", "redis", "sentinel"]  # sentinel: the master a real redis-sentinel names


# A TTL that a test waits out (``StoreTime.lapse``). The memory store lapses it on a fake clock;
# Redis's own expiry (PEXPIRE) runs on real time, so there it is a real second: hundreds of times
# the few milliseconds of work a test does while such a record must still be there.
SHORT_TTL_S = 1.0


class StoreTime:
    """The time a store's TTLs run on: the memory store's injected clock, a ``FakeClock`` that
    moves only on ``lapse``; Redis's own clock (the records' TTLs are Redis's), real time,
    where ``lapse`` waits it out."""

    def __init__(self, kind: str) -> None:
        self.fake = FakeClock(time.time()) if kind == "memory" else None

    def __call__(self) -> float:
        return time.time() if self.fake is None else self.fake()

    async def lapse(self, seconds: float) -> None:
        """Let ``seconds`` pass on the store's clock."""
        if self.fake is None:
            await asyncio.sleep(seconds)
        else:
            self.fake.advance(seconds)


def make_backend(url: str, clock: StoreTime | None = None, **ttl: float) -> Backend:
    binding_ttl = ttl.get("binding_ttl_s", 60.0)
    retain = ttl.get("retain_s", 120.0)
    if url == "memory":
        store = MemoryStore(binding_ttl_s=binding_ttl, retain_s=retain, clock=clock or time.time)
        return memory_backend(store)
    return redis_backend(url, namespace=f"t{next(_ns)}", binding_ttl_s=binding_ttl, retain_s=retain)


@pytest.fixture(params=STORES)
def store_kind(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
def store_url(store_kind: str, request: pytest.FixtureRequest) -> str:
    """``memory``, or the URL of the Redis (or Sentinel group) the kind needs, started once."""
    if store_kind == "memory":
        return "memory"
    server = request.getfixturevalue("redis_server" if store_kind == "redis" else "redis_sentinel")
    return str(server.url)


@pytest.fixture
def store_time(store_kind: str) -> StoreTime:
    return StoreTime(store_kind)


@pytest.fixture
async def backend_factory(
    store_url: str, store_time: StoreTime
) -> AsyncIterator[Callable[..., Any]]:
    opened: list[Backend] = []

    async def make(**ttl: float) -> Backend:
        backend = make_backend(store_url, store_time, **ttl)
        await backend.start()
        opened.append(backend)
        return backend

    yield make
    for backend in opened:
        await backend.close()


@pytest.fixture
def store_factory(backend_factory: Callable[..., Any]) -> Callable[..., Any]:
    """Stores alone: each the store of a fresh backend."""

    async def make(**ttl: float) -> Store:
        backend: Backend = await backend_factory(**ttl)
        return backend.store

    return make


@pytest.fixture
def private_redis(tmp_path: Path) -> Iterator[RedisServer]:
    """A redis-server of the test's own, for tests that stop or kill it."""
    server = RedisServer(tmp_path / "redis")
    server.start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
async def backend(backend_factory: Callable[..., Any]) -> Backend:
    b: Backend = await backend_factory()
    return b


@pytest.fixture
def store(backend: Backend) -> Store:
    return backend.store


@pytest.fixture
async def api_factory(store_url: str, store_time: StoreTime) -> AsyncIterator[Callable[..., Any]]:
    """Build the app around a fresh store (on ``store_time``) and return an httpx client
    speaking ASGI to it."""
    opened: list[tuple[Backend, httpx.AsyncClient]] = []

    async def make(**settings: Any) -> httpx.AsyncClient:
        ttl = {k: settings[k] for k in ("binding_ttl_s", "retain_s") if k in settings}
        backend = make_backend(store_url, store_time, **ttl)
        await backend.start()
        app = create_app(MetaserverSettings(**settings), backend=backend)
        client = httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url="http://ms")
        opened.append((backend, client))
        return client

    yield make
    for backend, client in opened:
        await client.aclose()
        await backend.close()


@pytest.fixture
async def api(api_factory: Callable[..., Any]) -> httpx.AsyncClient:
    client: httpx.AsyncClient = await api_factory()
    return client


DECODE_KV = KVEndpoint(host="10.0.0.7", port=5600)


def decode_instance(**over: Any) -> InstanceSpec:
    base: dict[str, Any] = {
        "role": "decode",
        "url": "http://10.0.0.7:8200",
        "kv_endpoint": DECODE_KV,
    }
    base.update(over)
    return InstanceSpec(**base)


def at(instance_id: str) -> dict[str, Any]:
    """A URL and KV endpoint of an instance's own (two live instances may not share them):
    ``decode_instance(**at("decode-3"))``. decode-0 keeps the defaults, which ``binding_spec``
    names."""
    if instance_id == "decode-0":
        return {}
    n = zlib.crc32(instance_id.encode())
    host = f"10.{100 + n % 100}.{(n >> 8) % 250}.{(n >> 16) % 250 + 1}"
    return {"url": f"http://{host}:8200", "kv_endpoint": {"host": host, "port": 5600}}


def binding_spec(**over: Any) -> BindingSpec:
    """A binding for decode-0, or for ``decode_instance_id`` at the KV endpoint ``at`` gives it."""
    decode = over.get("decode_instance_id", "decode-0")
    base: dict[str, Any] = {
        "request_id": "chatcmpl-abc-0",
        "decode_instance_id": "decode-0",
        "engine_id": "engine-d0",
        "kv_endpoint": at(decode).get("kv_endpoint", DECODE_KV),
        "tp_size": 1,
        "block_size": 16,
        "block_ids": [[4, 5, 6]],
        "num_cached_tokens": 16,
        "num_prompt_tokens": 40,
    }
    base.update(over)
    return BindingSpec(**base)


TOKENS = {
    "admin": "admin-token-0123456789",
    "proxy": "proxy-token-0123456789",
    "reader": "reader-token-012345678",
    "decode-0": "decode-0-token-0123456",
    "prefill-pool": "prefill-pool-token-012",
}


def write_credentials(tmp_path: Path, **tokens: str) -> Path:
    """A roles-mode credentials file: admin, proxy, reader, an engine bound to ``decode-0`` (may
    register only a decode), and a pool credential for every ``prefill-*`` id (its token read
    from a file). ``tokens`` overrides TOKENS by name."""
    t = TOKENS | tokens
    token_file = tmp_path / "prefill-pool.token"
    token_file.write_text(t["prefill-pool"] + "\n")
    text = f"""\
credentials:
  - {{name: ops, role: admin, token: {t["admin"]}}}
  - {{name: proxies, role: proxy, token: {t["proxy"]}}}
  - {{name: grafana, role: reader, token: {t["reader"]}}}
  - {{name: decode-0, role: engine, instance: decode-0, engine_role: decode,
      token: {t["decode-0"]}}}
  - {{name: prefill-pool, role: engine, instance: "prefill-*", engine_role: prefill,
      token_file: {token_file}}}
"""
    path = tmp_path / "credentials.yaml"
    path.write_text(text)
    return path
