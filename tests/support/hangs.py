"""What a hung test reports. pytest-timeout (``timeout`` in pyproject.toml) fails a test that
runs past its limit, so one hang costs that test rather than the whole CI run; its report
shows each thread's stack, which for an async test is only the event loop's ``select``. This
plugin adds the stack of every task of the loop that was running, where an async hang is
seen."""

from __future__ import annotations

import asyncio
import gc
import inspect
import signal
import traceback
from collections.abc import Generator
from types import FrameType
from typing import Any

import pytest


def write_tasks(tw: Any) -> None:
    """Every task of the running event loop, with its stack, to the terminal writer ``tw``;
    nothing when no loop runs here."""
    try:
        loop = asyncio.get_running_loop()
    except RuntimeError:
        return
    tasks = asyncio.all_tasks(loop)
    tw.sep("+", title=f"asyncio tasks of the running loop: {len(tasks)}")
    for task in tasks:
        tw.sep("~", f"{task.get_name()}{' (cancelling)' if task.cancelling() else ''}")
        tw.write("".join(traceback.format_list(await_chain(task.get_coro()))))


def await_chain(coro: Any) -> list[traceback.FrameSummary]:
    """Where a suspended coroutine waits: its frame and those of what it awaits, down to the
    innermost (``Task.print_stack`` shows only the outermost coroutine's)."""
    frames: list[traceback.FrameSummary] = []
    while coro is not None and len(frames) < _MAX_FRAMES:
        frame = next((getattr(coro, a) for a in _FRAME if getattr(coro, a, None)), None)
        if frame is not None:
            code = frame.f_code
            frames.append(traceback.FrameSummary(code.co_filename, frame.f_lineno, code.co_name))
        awaited = next((getattr(coro, a) for a in _AWAITS if hasattr(coro, a)), None)
        coro = awaited if awaited is not None else _asend_generator(coro)
    return frames


_MAX_FRAMES = 200
_FRAME = ("cr_frame", "ag_frame", "gi_frame")
_AWAITS = ("cr_await", "ag_await", "gi_yieldfrom")


def _asend_generator(awaitable: Any) -> Any:
    """The async generator an ``async for`` step runs (``async_generator_asend`` has no
    attribute naming it); None for anything else."""
    if type(awaitable).__name__ not in ("async_generator_asend", "async_generator_athrow"):
        return None
    return next((r for r in gc.get_referents(awaitable) if inspect.isasyncgen(r)), None)


@pytest.hookimpl(wrapper=True)
def pytest_timeout_set_timer(item: pytest.Item, settings: Any) -> Generator[None, object, object]:
    result = yield
    fail = signal.getsignal(signal.SIGALRM)
    if callable(fail):  # the signal method (the thread method ends the process instead)

        def write_tasks_then_fail(signum: int, frame: FrameType | None) -> None:
            write_tasks(item.config.get_terminal_writer())
            fail(signum, frame)

        signal.signal(signal.SIGALRM, write_tasks_then_fail)
    return result
