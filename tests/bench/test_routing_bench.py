"""The routing bench's own arithmetic: its workload and the best possible hit rate."""

from __future__ import annotations

from tests.bench.routing_bench import Phase, Workload, parse_args
from tests.e2e.stack import BLOCK_SIZE


def test_best_hit_rate_counts_blocks_seen_before() -> None:
    a = list(range(3 * BLOCK_SIZE))
    b = a[: 2 * BLOCK_SIZE] + [7] * BLOCK_SIZE  # shares two blocks with a
    w = Workload([a, b, a])
    # a: nothing; b: 2 blocks; a again: 2 of its 3 blocks (vLLM keeps the last token to compute)
    assert w.best_hit_rate() == (2 + 2) * BLOCK_SIZE / (9 * BLOCK_SIZE)


def test_workload_shape() -> None:
    a = parse_args(["--systems", "2", "--users", "2", "--sessions", "2", "--turns", "3"])
    w = Workload.make(a)
    assert len(w.prompts) == 2 * 2 + 2 * 3
    turns = [p for p in w.prompts if len(p) > a.system_tokens + 200]
    assert turns, "sessions grow turn by turn"
    assert Workload.make(a).prompts == w.prompts  # seeded: every phase sends the same


def test_phase_figures() -> None:
    ph = Phase("x", hit=300.0, computed={"p0": 600.0, "p1": 100.0})
    assert ph.hit_rate == 0.3 and ph.split == 600 / 700
