"""The serving bench's parts that need no engine: the workload from a seed, goodput, the table
and the pictures (the bench itself runs for an hour: docs/benchmarks.md)."""

from __future__ import annotations

import statistics
from pathlib import Path

from tests.bench.serving.client import Result
from tests.bench.serving.report import Point, Slo, pictures, table
from tests.bench.serving.workload import Mix, build


def test_the_same_seed_gives_the_same_requests_and_a_higher_rate_only_more_of_them() -> None:
    slow, again = build(3, 0.1, 600), build(3, 0.1, 600)
    assert [(r.prompt, r.max_tokens, r.at_s) for r in slow] == [
        (r.prompt, r.max_tokens, r.at_s) for r in again
    ]
    fast = build(3, 0.4, 600)
    assert 2.5 < len(fast) / len(slow) < 6  # sessions add turns at their own pace
    first = [(r.kind, len(r.prompt), r.max_tokens) for r in slow if r.turn == 0][:5]
    assert first == [(r.kind, len(r.prompt), r.max_tokens) for r in fast if r.turn == 0][:5]


def test_each_kind_has_its_lengths_and_sessions_resend_their_history() -> None:
    reqs = build(5, 0.5, 1200, mix=Mix(document=1, chat=1, session=1))
    docs = [r for r in reqs if r.kind == "document"]
    chats = [r for r in reqs if r.kind == "chat"]
    assert docs and all(1500 <= len(r.prompt) <= 3000 and 16 <= r.max_tokens <= 64 for r in docs)
    assert chats and all(100 <= len(r.prompt) <= 400 and 100 <= r.max_tokens <= 300 for r in chats)
    by_session: dict[int, list[list[int]]] = {}
    for r in sorted((r for r in reqs if r.kind == "session"), key=lambda r: (r.session, r.turn)):
        by_session.setdefault(r.session, []).append(r.prompt)
    assert by_session
    for turns in by_session.values():
        for before, after in zip(turns, turns[1:], strict=False):
            assert after[: len(before)] == before and len(after) > len(before)


def test_bursty_arrivals_have_the_same_mean_gap_and_twice_the_spread() -> None:
    def gaps(pattern: str) -> list[float]:
        ats = [r.at_s for r in build(9, 1.0, 4000, pattern, Mix(0, 1, 0))]  # type: ignore[arg-type]
        return [b - a for a, b in zip(ats, ats[1:], strict=False)]

    poisson, bursty = gaps("poisson"), gaps("bursty")
    assert abs(statistics.mean(poisson) - 1) < 0.1 and abs(statistics.mean(bursty) - 1) < 0.15
    cv = lambda xs: statistics.pstdev(xs) / statistics.mean(xs)  # noqa: E731
    assert 0.9 < cv(poisson) < 1.1 and 1.7 < cv(bursty) < 2.3


def _result(ttft: float | None, gaps: list[float], error: str = "") -> Result:
    req = build(1, 1.0, 10)[0]
    return Result(req, ttft_s=ttft, gaps_s=gaps, total_s=(ttft or 0) + sum(gaps), error=error)


def test_goodput_counts_answers_within_both_targets(tmp_path: Path) -> None:
    slo = Slo(ttft_s=1.0, itl_s=0.1)
    results = [
        _result(0.5, [0.05, 0.05]),  # meets both
        _result(0.5, []),  # one token: meets the ITL target by definition
        _result(1.5, [0.05]),  # first token late
        _result(0.5, [0.05, 0.3]),  # mean ITL 0.175 s
        _result(None, [], "HTTP 503: no"),  # failed
    ]
    p = Point("pd", 0.5, 0, 10.0, results, disaggregated=0.75)
    assert p.goodput(slo) == 0.2 and p.throughput() == 0.4
    text = table([p], slo)
    assert "| pd | 0.5 | 0 | 5 | 1 |" in text and "75%" in text
    made = pictures([p, Point("aggregated", 0.5, 0, 10.0, results[:1])], slo, tmp_path)
    assert [m.name for m in made] == ["goodput.png", "itl.png"]
    assert all(m.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" for m in made)
