"""Rescues: a test that ran part of itself again because the machine paused. The end-to-end
suites may do that only for a pause every CPU's watcher measured (``tests/e2e/pauses.py``),
never for a stall of the test process alone, and only after judging what the first try got.
Each rescue is recorded here and listed at the end of the run with its cause; the summary
always shows the count, 0 being the expected state."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import pytest


@dataclass(frozen=True)
class Rescue:
    test: str  # the test's node id (or the fixture's, for a module-scoped scenario)
    cause: str  # what was measured, e.g. "the machine paused 19.8s during the first try"


RESCUES: list[Rescue] = []


def record(cause: str) -> Rescue:
    """Note that the running test (or fixture) is trying again, and why."""
    current = os.environ.get("PYTEST_CURRENT_TEST", "outside a test").rsplit(" (", 1)[0]
    rescue = Rescue(current, cause)
    RESCUES.append(rescue)
    print(f"[rescue] {rescue.test}: {cause}", flush=True)
    return rescue


def pytest_terminal_summary(terminalreporter: Any, config: pytest.Config) -> None:
    tr = terminalreporter
    tr.section(f"rescues: {len(RESCUES)} (tries run again after a measured machine pause)")
    for r in RESCUES:
        tr.write_line(f"{r.test}: {r.cause}")
