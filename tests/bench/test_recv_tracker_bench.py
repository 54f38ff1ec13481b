"""``recv_tracker_bench.py`` runs end to end: the baseline tracker (from git) and the current
one take the same flood, and the current one holds at most ``MAX_EARLY`` entries."""

from __future__ import annotations

import subprocess
import sys

from tests.support.procs import REPO


def test_recv_tracker_bench_prints_before_and_after_per_flood() -> None:
    out = subprocess.run(
        [sys.executable, "tests/bench/recv_tracker_bench.py", "--polls", "3",
         "--max-flood", "30000"],
        cwd=REPO, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert out.returncode == 0, out.stdout + out.stderr
    rows = [line.split() for line in out.stdout.splitlines()[2:]]
    assert [r[0] for r in rows] == ["0", "4,096", "30,000"], out.stdout
    assert rows[-1][2] == "30,000" and rows[-1][5] == "4,096", out.stdout  # held: before, after
