"""D's leg runs in its own task while the request's task waits for the binding and P: the watch
that lets D's end interrupt the request's task, and the two helpers around D's task."""

from __future__ import annotations

import asyncio
from typing import Any

from proxy.flows.base import Upstream


class DecodeWatch:
    """While armed, D's task failing interrupts the request's task, and so does D answering:
    at once (``any_end``: the binding wait), or after ``grace`` seconds (P's leg: P's report
    may still come; a P that hangs must not hold D's answer)."""

    __slots__ = ("_timer", "any_end", "armed", "fired", "grace", "task")

    def __init__(self, task: asyncio.Task[Any], grace: float) -> None:
        self.task = task
        self.grace = grace
        self.armed = False
        self.any_end = True
        self.fired = False
        self._timer: asyncio.TimerHandle | None = None

    def __call__(self, d_task: asyncio.Task[Upstream]) -> None:
        if not self.armed or self.fired:
            return
        if self.any_end or d_task.cancelled() or d_task.exception() is not None:
            self._fire()
        else:
            self._timer = self.task.get_loop().call_later(self.grace, self._fire)

    def _fire(self) -> None:
        self._timer = None
        if self.armed and not self.fired:
            self.fired = True
            self.task.cancel()

    def disarm(self) -> None:
        self.armed = False
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def absorb(self) -> bool:
        """In an ``except CancelledError``: True when the cancel was ours alone."""
        return self.fired and self.task.uncancel() == 0


def answered(d_task: asyncio.Task[Upstream]) -> bool:
    return d_task.done() and not d_task.cancelled() and d_task.exception() is None


def drop(d_task: asyncio.Task[Upstream]) -> None:
    """Cancel D's leg if it still runs; close its answer if it came; retrieve its error."""
    if not d_task.done():
        d_task.cancel()
    elif not d_task.cancelled() and d_task.exception() is None:
        d_task.result().close()
