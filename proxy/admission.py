"""Admission control: at most ``limit`` client requests in flight; beyond it, 429."""

from __future__ import annotations

from proxy.errors import Overloaded


class Admission:
    __slots__ = ("inflight", "limit")

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.inflight = 0

    def enter(self) -> None:
        if self.inflight >= self.limit:
            raise Overloaded(f"more than {self.limit} requests in flight", retry_after=1)
        self.inflight += 1

    def leave(self) -> None:
        self.inflight -= 1
