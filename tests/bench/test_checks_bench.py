"""``checks_bench.py`` runs end to end and measures every check against a baseline (its numbers
are judged in docs/benchmarks.md)."""

from __future__ import annotations

import subprocess
import sys

from tests.support.procs import REPO


def test_checks_bench_prints_a_row_per_check() -> None:
    out = subprocess.run(
        [sys.executable, "tests/bench/checks_bench.py", "--seconds", "0.02"],
        cwd=REPO, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert out.returncode == 0, out.stdout + out.stderr
    rows = out.stdout.splitlines()[1:]
    assert len(rows) == 6 and all(len(r.split()) >= 6 for r in rows), out.stdout
    assert "who, roles (50)" in out.stdout and "differs_from (64 blocks)" in out.stdout
