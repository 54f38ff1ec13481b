"""``memory_store_bench.py`` runs end to end and its baseline is the old sweep (numbers are
judged in docs/benchmarks.md)."""

from __future__ import annotations

import subprocess
import sys

from tests.bench.memory_store_bench import SCAN_EVERY, ScanSweep
from tests.support.procs import REPO


def test_memory_store_bench_runs_and_prints_both_stores() -> None:
    argv = [sys.executable, "tests/bench/memory_store_bench.py", "--sizes", "1000,3000"]
    out = subprocess.run(
        [*argv, "--writes", "300", "--rounds", "1"],
        cwd=REPO, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert out.returncode == 0, out.stdout + out.stderr
    assert "| 1,000 |" in out.stdout and "| 3,000 |" in out.stdout
    assert "write cost at 3,000 vs 1,000 live bindings" in out.stdout


def test_memory_store_bench_rejects_an_empty_size_list() -> None:
    out = subprocess.run(
        [sys.executable, "tests/bench/memory_store_bench.py", "--sizes", ","],
        cwd=REPO, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert out.returncode == 2 and "must be positive" in out.stderr


def test_memory_store_bench_baseline_sweeps_only_every_512th_write() -> None:
    clock = [0.0]
    store = ScanSweep(binding_ttl_s=1, retain_s=1, clock=lambda: clock[0])
    store._bindings["x"] = None  # type: ignore[assignment]  # never looked at between sweeps
    for _ in range(SCAN_EVERY - 1):
        store._sweep()
    assert "x" in store._bindings
