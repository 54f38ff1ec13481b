"""The serving bench's workload: which requests arrive when, from one seed.

Three kinds, mixed by ``Mix`` (shares of arrivals):
- ``document``: a long document and a short answer (1,500-3,000 prompt tokens, 16-64 out);
- ``chat``: a short prompt and a long streamed answer (100-400 in, 100-300 out);
- ``session``: a conversation of 3-5 turns; each turn resends the whole history (the previous
  prompt, tokens standing for the previous answer, 50-150 new tokens) ``think_s`` after the
  previous turn's arrival. The history's answer tokens are drawn from the seed, not the
  engine's answer: the prompt shares its prefix with the previous turn's prompt, which is what
  prefix caches see; the previous answer's own KV is not reused.

Arrivals are open-loop: ``poisson`` (exponential gaps at ``rate``), or ``bursty`` (gamma gaps of
the same mean with a coefficient of variation of 2: bursts and lulls). Every token id is drawn in
3..1000 (no special tokens); every request sets ``ignore_eos`` so it produces ``max_tokens``.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Literal

Pattern = Literal["poisson", "bursty"]
BURST_SHAPE = 0.25  # gamma shape: coefficient of variation 1 / sqrt(shape) = 2


@dataclass(frozen=True)
class Mix:
    document: float = 0.2
    chat: float = 0.6
    session: float = 0.2


@dataclass(frozen=True)
class Req:
    idx: int
    kind: str
    at_s: float  # seconds after the run's start
    prompt: list[int]
    max_tokens: int
    session: int = -1  # -1: not part of a session
    turn: int = 0


def tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randint(3, 1000) for _ in range(n)]


def gaps(rng: random.Random, rate: float, pattern: Pattern) -> float:
    if pattern == "poisson":
        return rng.expovariate(rate)
    return rng.gammavariate(BURST_SHAPE, 1.0 / (BURST_SHAPE * rate))


def build(
    seed: int,
    rate: float,
    duration_s: float,
    pattern: Pattern = "poisson",
    mix: Mix = Mix(),
    think_s: tuple[float, float] = (5.0, 15.0),
) -> list[Req]:
    """Every request arriving in ``[0, duration_s)``, in arrival order. The contents are drawn
    from ``seed`` alone: at every rate the run's first requests are the same prompts with the
    same answer lengths (a higher rate only brings them sooner, and more of them)."""
    arrive = random.Random(seed * 7919 + round(rate * 1000))
    content = random.Random(seed)
    kinds = ("document", "chat", "session")
    weights = (mix.document, mix.chat, mix.session)
    out: list[Req] = []
    t = gaps(arrive, rate, pattern)
    sessions = 0
    while t < duration_s:
        kind = content.choices(kinds, weights)[0]
        if kind == "document":
            out.append(Req(0, kind, t, tokens(content, content.randint(1500, 3000)),
                           content.randint(16, 64)))  # fmt: skip
        elif kind == "chat":
            out.append(Req(0, kind, t, tokens(content, content.randint(100, 400)),
                           content.randint(100, 300)))  # fmt: skip
        else:
            history = tokens(content, content.randint(100, 400))
            at = t
            for turn in range(content.randint(3, 5)):
                answer = content.randint(50, 200)
                if at < duration_s:
                    out.append(Req(0, kind, at, list(history), answer, sessions, turn))
                history += tokens(content, answer) + tokens(content, content.randint(50, 150))
                at += content.uniform(*think_s)
            sessions += 1
        t += gaps(arrive, rate, pattern)
    out.sort(key=lambda r: r.at_s)
    return [Req(i, r.kind, r.at_s, r.prompt, r.max_tokens, r.session, r.turn)
            for i, r in enumerate(out)]  # fmt: skip
