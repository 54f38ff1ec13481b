"""Time the test decides, so that an outcome never depends on how the machine schedules it.

``FakeClock``: a ``Callable[[], float]`` for a component's injected ``clock``; it moves only
when the test calls ``advance``.

``virtual_time``: runs an ``async def`` test on an event loop of its own whose clock is
virtual: ``asyncio.sleep``, ``wait_for``, ``call_later`` and ``loop.time()`` all read it, and
it jumps to the next timer only when every task is waiting (nothing is ready to run and no I/O
is pending). A test on it sees ``sleep(0.01)`` as exactly 10 ms however slow the machine is,
and a component given ``clock=asyncio.get_running_loop().time`` shares the same time. It is
for code that talks to in-process fakes: I/O on real sockets runs, but virtual time does not
wait for it.
"""

from __future__ import annotations

import asyncio
import functools
import selectors
from collections.abc import Callable, Coroutine
from typing import Any, ParamSpec

P = ParamSpec("P")


class FakeClock:
    def __init__(self, now: float = 1000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


class _IdleJumps(selectors.DefaultSelector):
    """A selector that never blocks while a timer is due later: it polls, and when nothing is
    ready it moves its loop's virtual clock to that timer instead of sleeping."""

    def __init__(self) -> None:
        super().__init__()
        self.loop: VirtualTimeLoop | None = None

    def select(self, timeout: float | None = None) -> list[tuple[selectors.SelectorKey, int]]:
        if timeout is None:  # no timer at all: only I/O (another thread's wake-up) can come
            return super().select(None)
        ready = super().select(0)
        if not ready and timeout > 0:
            assert self.loop is not None
            self.loop.now += timeout
        return ready


class VirtualTimeLoop(asyncio.SelectorEventLoop):
    def __init__(self) -> None:
        selector = _IdleJumps()
        super().__init__(selector)
        selector.loop = self
        self.now = 0.0

    def time(self) -> float:
        return self.now


def run_virtual(coro: Coroutine[Any, Any, Any]) -> Any:
    loop = VirtualTimeLoop()
    try:
        return loop.run_until_complete(coro)
    finally:
        loop.run_until_complete(loop.shutdown_asyncgens())
        loop.close()


def virtual_time(test: Callable[P, Coroutine[Any, Any, None]]) -> Callable[P, None]:
    """Decorate an ``async def`` test to run it on a ``VirtualTimeLoop`` (its fixtures must be
    plain, not async: they would belong to pytest-asyncio's loop)."""

    @functools.wraps(test)
    def run(*args: P.args, **kwargs: P.kwargs) -> None:
        run_virtual(test(*args, **kwargs))

    return run
