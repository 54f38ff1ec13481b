"""The benchmark script still runs end to end (its numbers are judged in docs/benchmarks.md)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.support.procs import REPO

pytestmark = pytest.mark.slow  # starts a metaserver and the benchmark: not in `make test-fast`


def test_bench_metaserver_script_runs() -> None:
    proc = subprocess.run(
        [
            sys.executable,
            "tests/bench/metaserver_bench.py",
            "--duration",
            "0.3",
            "--rate",
            "200",
            "--concurrency",
            "8",
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    for row in (
        "| redis-py write+read",
        "| metaserver PUT+GET",
        "| metaserver PUT only",
        "metaserver CPU per PUT",
        "writes/s at saturation",
    ):
        assert row in proc.stdout
    assert "unexpected statuses" not in proc.stdout
