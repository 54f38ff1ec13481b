"""Median wall time of repeated calls, for the micro-benchmarks."""

from __future__ import annotations

import statistics
import time
from collections.abc import Awaitable, Callable
from typing import Any


def median_s(fn: Callable[[], Any], repeat: int) -> float:
    samples = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t0)
    return statistics.median(samples)


async def amedian_s(fn: Callable[[], Awaitable[Any]], repeat: int) -> float:
    samples = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        await fn()
        samples.append(time.perf_counter() - t0)
    return statistics.median(samples)
