"""Per-instance circuit breaker: closed → open after N consecutive failures → half-open trial."""

from __future__ import annotations

import enum
from collections.abc import Callable


class CircuitState(enum.StrEnum):
    CLOSED = "closed"
    OPEN = "open"
    HALF_OPEN = "half_open"


class CircuitBreaker:
    """``allows()`` says whether a request may go; ``record(ok)`` reports its outcome.

    Open for ``open_s`` seconds after ``failures`` consecutive failures; then one trial request
    is let through (half-open): success closes the circuit, failure opens it again.
    """

    __slots__ = ("_clock", "_failures", "_open_s", "_opened_at", "_trial", "consecutive", "opens")

    def __init__(self, failures: int, open_s: float, clock: Callable[[], float]) -> None:
        self._failures = failures
        self._open_s = open_s
        self._clock = clock
        self._opened_at: float | None = None
        self._trial = False
        self.consecutive = 0
        self.opens = 0

    @property
    def state(self) -> CircuitState:
        if self._opened_at is None:
            return CircuitState.CLOSED
        if self._clock() - self._opened_at < self._open_s:
            return CircuitState.OPEN
        return CircuitState.HALF_OPEN

    def allows(self) -> bool:
        if self._opened_at is None:
            return True
        return self.state == CircuitState.HALF_OPEN and not self._trial

    def on_dispatch(self) -> None:
        if self._opened_at is not None:
            self._trial = True  # the half-open trial is under way

    def record(self, ok: bool) -> None:
        if ok:
            self.consecutive = 0
            self._opened_at = None
            self._trial = False
            return
        self.consecutive += 1
        if self._opened_at is not None or self.consecutive >= self._failures:
            if self._opened_at is None:
                self.opens += 1
            self._opened_at = self._clock()
            self._trial = False
