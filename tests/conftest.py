"""Session-wide real services: one redis-server per test session (free port, cleaned up), and
the tiny generated model."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests.support.procs import REPO
from tests.support.services import MetaserverProcess, RedisSentinelGroup, RedisServer

pytest_plugins = ["tests.support.hangs", "tests.support.budget", "tests.support.rescues"]


@pytest.fixture(scope="session")
def tiny_model() -> Path:
    """The small random Llama the suite generates (cached under .cache/models)."""
    from launch.tiny_model import make_tiny_model

    return make_tiny_model(REPO / ".cache" / "models")


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    server = RedisServer(tmp_path_factory.mktemp("redis"))
    server.start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="session")
def redis_sentinel(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisSentinelGroup]:
    group = RedisSentinelGroup(tmp_path_factory.mktemp("sentinel"))
    group.start()
    try:
        yield group
    finally:
        group.stop()


@pytest.fixture
def metaserver_factory(
    tmp_path: Path,
) -> Iterator[Callable[..., MetaserverProcess]]:
    """Start ``pd-metaserver`` processes: ``metaserver_factory("memory", "--token", "t")``."""
    started: list[MetaserverProcess] = []

    def start(
        store: str = "memory", *extra: str, port: int | None = None, ready_timeout_s: float = 30.0
    ) -> MetaserverProcess:
        proc = MetaserverProcess(
            store, *extra, log_dir=tmp_path, port=port, ready_timeout_s=ready_timeout_s
        )
        started.append(proc)
        return proc

    try:
        yield start
    finally:
        for proc in started:
            proc.stop()
