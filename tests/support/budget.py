"""A time budget for the whole run. CI kills a run at 90 minutes and then shows nothing: no
summary, no list of failures. With ``PDGATE_TEST_BUDGET_S`` set (``.ci/run`` sets it, counting
from the start of CI, install included) a run that reaches its budget stops before the next
test with a message naming how many tests and which modules were left, and the summary of what
did run is printed as usual. The run then fails: a test that was not run is not a pass.

``PDGATE_TEST_STARTED_AT`` (a ``date +%s`` reading) is when the budget began; without it, the
budget counts from the start of this pytest session."""

from __future__ import annotations

import os
import time
from collections import Counter
from typing import Any

import pytest

BUDGET_ENV = "PDGATE_TEST_BUDGET_S"
STARTED_ENV = "PDGATE_TEST_STARTED_AT"
_LEFT = pytest.StashKey[list[str]]()
_BUDGET = pytest.StashKey[tuple[float, float]]()  # (started, limit)


def budget_s() -> float | None:
    raw = os.environ.get(BUDGET_ENV, "").strip()
    if not raw:
        return None
    try:
        value = float(raw)
    except ValueError:
        raise pytest.UsageError(f"{BUDGET_ENV}={raw!r} is not a number of seconds") from None
    if value <= 0:
        raise pytest.UsageError(f"{BUDGET_ENV}={raw!r} must be positive")
    return value


def started_at() -> float:
    """The budget's start as a ``time.time()`` reading."""
    raw = os.environ.get(STARTED_ENV, "").strip()
    return float(raw) if raw else time.time()


def summarize(nodeids: list[str]) -> str:
    """``"12 tests in tests/e2e/test_chaos.py (8), tests/e2e/test_traces.py (4)"``."""
    modules = Counter(n.split("::", 1)[0] for n in nodeids)
    listed = ", ".join(f"{m} ({k})" for m, k in modules.items())
    return f"{len(nodeids)} tests in {listed}"


def pytest_configure(config: pytest.Config) -> None:
    limit = budget_s()
    if limit is not None:
        config.stash[_BUDGET] = (started_at(), limit)


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Any:
    budget = item.config.stash.get(_BUDGET, None)
    if budget is None:
        return None
    began, limit = budget
    spent = time.time() - began
    if spent < limit:
        return None
    session = item.session
    left = [i.nodeid for i in session.items[session.items.index(item) :]]
    item.config.stash[_LEFT] = left
    session.shouldstop = (
        f"the run's time budget ({BUDGET_ENV}={limit:.0f}s) is spent after {spent:.0f}s; "
        f"not run: {summarize(left)}"
    )
    return True  # this item is not run either


def pytest_terminal_summary(terminalreporter: Any, config: pytest.Config) -> None:
    left = config.stash.get(_LEFT, None)
    if left:
        terminalreporter.section("time budget spent: tests not run", red=True)
        for nodeid in left:
            terminalreporter.write_line(nodeid)


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    if session.config.stash.get(_LEFT, None) and exitstatus == 0:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
