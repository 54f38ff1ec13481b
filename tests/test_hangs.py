"""The suite's guard against hung tests (pyproject's ``timeout``, ``tests/support/hangs.py``):
run on a hanging async test in a pytest of its own."""

from __future__ import annotations

import subprocess
import sys
import tomllib
from pathlib import Path

from tests.support.procs import REPO

HANGING = """
import asyncio


async def wait_for_nothing():
    await asyncio.Event().wait()


async def test_hangs():
    await asyncio.create_task(wait_for_nothing(), name="the-stuck-helper")


async def test_after_the_hang():
    await asyncio.sleep(0)
"""


def test_hangs_a_hung_async_test_fails_with_its_tasks_and_the_run_goes_on(tmp_path: Path) -> None:
    (tmp_path / "test_sample.py").write_text(HANGING)
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-p",
            "tests.support.hangs",
            "-o",
            "asyncio_mode=auto",
            "--timeout",
            "2",
            "-p",
            "no:cacheprovider",
            str(tmp_path / "test_sample.py"),
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    out = run.stdout + run.stderr
    assert run.returncode == 1, out
    assert "1 failed, 1 passed" in out, out
    assert "Timeout (>2.0s)" in out, out
    # the report names the task the test waits on and where it waits
    assert "the-stuck-helper" in out and "in wait_for_nothing" in out, out


def test_hangs_the_suite_sets_a_timeout() -> None:
    ini = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["pytest"]["ini_options"]
    assert 300 <= ini["timeout"] <= 1800
    assert "tests.support.hangs" in (REPO / "tests" / "conftest.py").read_text()
