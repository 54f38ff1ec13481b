"""The run's time budget (``tests/support/budget.py``): a run past it stops before the next
test, names what it did not run, and fails; run in a pytest of its own."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

from tests.support.procs import REPO

SAMPLE = """
import os
import time


def test_first():
    # the budget runs out during this test, however long the run took to reach it
    os.environ["SPEND"] and time.sleep(float(os.environ["SPEND"]))


def test_second():
    pass


def test_third():
    pass
"""


def run_sample(tmp_path: Path, **env: str) -> subprocess.CompletedProcess[str]:
    (tmp_path / "test_sample.py").write_text(SAMPLE)
    (tmp_path / "pytest.ini").write_text("[pytest]\n")  # not the repo's settings
    clean = {k: v for k, v in os.environ.items() if not k.startswith("PDGATE_TEST_")}
    # only the plugin under test: the installed ones (schemathesis, hypothesis) take seconds
    alone = {"PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1", "PYTHONPATH": str(REPO)}
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "tests.support.budget", "-p", "no:cacheprovider",
         "-rfE", "test_sample.py"],
        cwd=tmp_path, capture_output=True, text=True, timeout=120, env=clean | alone | env,
    )  # fmt: skip


def test_budget_a_spent_budget_stops_the_run_and_names_what_is_left(tmp_path: Path) -> None:
    began = int(time.time())
    # a budget that is spent 1 s after the sample's first test starts, at the latest
    run = run_sample(
        tmp_path, PDGATE_TEST_BUDGET_S="1", PDGATE_TEST_STARTED_AT=str(began), SPEND="1.1"
    )
    out = run.stdout + run.stderr
    assert run.returncode != 0, out
    assert "time budget spent: tests not run" in out, out
    assert "test_sample.py::test_second" in out and "test_sample.py::test_third" in out, out
    assert "::test_second" not in out.partition("time budget spent")[0], out  # never began


def test_budget_counts_from_the_given_start(tmp_path: Path) -> None:
    """CI's budget starts before the install: a start long ago stops the run at once."""
    run = run_sample(
        tmp_path,
        PDGATE_TEST_BUDGET_S="60",
        PDGATE_TEST_STARTED_AT=str(int(time.time()) - 61),
        SPEND="0",
    )
    out = run.stdout + run.stderr
    assert run.returncode != 0, out
    assert "not run: 3 tests in" in out, out


def test_budget_a_run_within_its_budget_is_untouched(tmp_path: Path) -> None:
    run = run_sample(tmp_path, PDGATE_TEST_BUDGET_S="600", SPEND="0")
    out = run.stdout + run.stderr
    assert run.returncode == 0, out
    assert "3 passed" in out, out


def test_budget_a_bad_setting_is_a_usage_error(tmp_path: Path) -> None:
    run = run_sample(tmp_path, PDGATE_TEST_BUDGET_S="eighty minutes", SPEND="0")
    assert run.returncode == 4, run.stdout + run.stderr
    assert "is not a number of seconds" in run.stdout + run.stderr
