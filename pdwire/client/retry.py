"""Retry policy of the clients: exponential backoff with full jitter, transient failures only."""

from __future__ import annotations

import random
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Backoff:
    """Delay before retry ``n`` (1-based): uniform in [0, min(cap, base * 2**(n-1))]."""

    base: float = 0.05
    cap: float = 2.0
    jitter: bool = True

    def compute(self, attempt: int) -> float:
        ceiling = min(self.cap, self.base * (2 ** (attempt - 1)))
        return random.uniform(0, ceiling) if self.jitter else ceiling


NO_BACKOFF = Backoff(base=0.0, cap=0.0, jitter=False)


@dataclass(frozen=True)
class RetryPolicy:
    """``retries`` extra attempts on connection errors, timeouts and 5xx; never on 4xx."""

    retries: int = 3
    backoff: Backoff = field(default_factory=Backoff)

    @staticmethod
    def retryable_status(status: int) -> bool:
        return status >= 500
