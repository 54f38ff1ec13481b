"""Real services for the proxy tests: a metaserver process, fake vLLM processes (two P, two D;
started once, knobs and records reset after every test) and the proxy itself, served by uvicorn
inside the test loop so that tests can look at its state."""

from __future__ import annotations

import asyncio
import math
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import httpx
import openai
import pytest
import uvicorn

from proxy import ProxySettings, create_app
from proxy.runtime import Runtime
from proxy.server import CoalescingHttpToolsProtocol
from tests.fakes import FakeVLLM
from tests.support.procs import free_port
from tests.support.services import MetaserverProcess


@dataclass
class Cluster:
    metaserver: MetaserverProcess
    prefill: list[FakeVLLM]
    decode: list[FakeVLLM]

    def fakes(self) -> list[FakeVLLM]:
        return [*self.prefill, *self.decode]


@pytest.fixture(scope="session")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    logs = tmp_path_factory.mktemp("proxy-cluster")
    started: list[Any] = []
    try:
        ms = MetaserverProcess("memory", log_dir=logs)
        started.append(ms)
        prefill, decode = [], []
        for _ in range(2):
            p = FakeVLLM("prefill", metaserver=ms.url, log_dir=logs)
            started.append(p)
            prefill.append(p)
            d = FakeVLLM("decode", metaserver=ms.url, log_dir=logs)
            started.append(d)
            decode.append(d)
        yield Cluster(ms, prefill, decode)
    finally:
        for s in reversed(started):
            s.stop()


@pytest.fixture(autouse=True)
def _reset_fakes(request: pytest.FixtureRequest) -> Iterator[None]:
    yield
    if "cluster" in request.fixturenames:
        for fake in request.getfixturevalue("cluster").fakes():
            fake.reset()


@dataclass
class RunningProxy:
    url: str
    runtime: Runtime
    server: uvicorn.Server
    task: asyncio.Task[None]
    clients: list[openai.AsyncOpenAI | httpx.AsyncClient] = field(default_factory=list)

    def client(self, **kw: Any) -> openai.AsyncOpenAI:
        """An OpenAI client of the proxy, closed with the proxy."""
        kw.setdefault("api_key", "unused")
        c = openai.AsyncOpenAI(base_url=self.url + "/v1", max_retries=0, **kw)
        self.clients.append(c)
        return c

    def http(self) -> httpx.AsyncClient:
        c = httpx.AsyncClient(base_url=self.url, timeout=30)
        self.clients.append(c)
        return c

    def admin(self) -> httpx.AsyncClient:
        """A client with the operator's key (``/v1/instances``, ``/admin``)."""
        c = httpx.AsyncClient(base_url=self.url, timeout=30, headers=ADMIN_HEADERS)
        self.clients.append(c)
        return c

    async def stop(self) -> None:
        for c in self.clients:
            await (c.close() if isinstance(c, openai.AsyncOpenAI) else c.aclose())
        self.server.should_exit = True
        await asyncio.wait_for(self.task, 15)


ProxyFactory = Callable[..., Awaitable[RunningProxy]]
ADMIN_KEY = "proxy-admin-key-0123"
ADMIN_HEADERS = {"authorization": f"Bearer {ADMIN_KEY}"}


async def serve_proxy(
    settings: dict[str, Any], uvicorn_http: Any = CoalescingHttpToolsProtocol
) -> RunningProxy:
    """Serve a proxy with uvicorn inside the test loop (``settings["port"]`` must be free);
    the caller stops it."""
    parsed = ProxySettings(**settings)
    app = create_app(parsed)
    config = uvicorn.Config(
        app, host="127.0.0.1", port=settings["port"], log_level="warning", lifespan="on",
        http=uvicorn_http,  # pd-proxy's protocol unless a test asks for uvicorn's own
        timeout_keep_alive=math.ceil(parsed.client_keepalive_s),  # as proxy.cli serves it
    )  # fmt: skip
    server = uvicorn.Server(config)
    task = asyncio.get_running_loop().create_task(server.serve())
    for _ in range(200):
        if server.started:
            break
        if task.done():
            task.result()
        await asyncio.sleep(0.02)
    return RunningProxy(f"http://127.0.0.1:{settings['port']}", app.runtime, server, task)


@pytest.fixture
async def proxy_factory(cluster: Cluster) -> AsyncIterator[ProxyFactory]:
    running: list[RunningProxy] = []

    async def start(
        uvicorn_http: Any = CoalescingHttpToolsProtocol, **overrides: Any
    ) -> RunningProxy:
        settings: dict[str, Any] = {
            "prefill": [cluster.prefill[0].url],
            "decode": [cluster.decode[0].url],
            "metaserver": cluster.metaserver.url,
            "port": free_port(),
            "health_interval_s": 0.2,
            "backoff_base_s": 0.0,
            "admin_keys": [ADMIN_KEY],
            **overrides,
        }
        proxy = await serve_proxy(settings, uvicorn_http)
        running.append(proxy)
        return proxy

    try:
        yield start
    finally:
        for proxy in running:
            await proxy.stop()


async def wait_until(check: Callable[[], bool], within: float = 5.0) -> None:
    deadline = asyncio.get_running_loop().time() + within
    while not check():
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError("condition not reached in time")
        await asyncio.sleep(0.02)
