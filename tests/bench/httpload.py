"""A lean keep-alive HTTP/1.1 load generator (asyncio streams, pre-built requests) so the client
costs far less CPU than the server under test."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass, field


@dataclass
class Latencies:
    samples: list[float] = field(default_factory=list)
    errors: int = 0
    statuses: dict[int, int] = field(default_factory=dict)

    def add(self, seconds: float, status: int) -> None:
        self.samples.append(seconds)
        self.statuses[status] = self.statuses.get(status, 0) + 1

    def merge(self, other: Latencies) -> None:
        self.samples.extend(other.samples)
        self.errors += other.errors
        for status, n in other.statuses.items():
            self.statuses[status] = self.statuses.get(status, 0) + n

    def pct(self, q: float) -> float:
        if not self.samples:
            return float("nan")
        s = sorted(self.samples)
        return s[min(len(s) - 1, int(q * len(s)))] * 1000


class Connection:
    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader = reader
        self.writer = writer

    @classmethod
    async def open(cls, host: str, port: int) -> Connection:
        reader, writer = await asyncio.open_connection(host, port)
        return cls(reader, writer)

    async def request(self, raw: bytes) -> tuple[int, bytes]:
        self.writer.write(raw)
        head = await self.reader.readuntil(b"\r\n\r\n")
        status = int(head[9:12])
        length = 0
        lower = head.lower()
        i = lower.find(b"content-length:")
        if i >= 0:
            length = int(lower[i + 15 : lower.index(b"\r\n", i)])
        body = await self.reader.readexactly(length) if length else b""
        return status, body

    def close(self) -> None:
        self.writer.close()


def build(method: str, path: str, host: str, body: bytes = b"", headers: str = "") -> bytes:
    head = f"{method} {path} HTTP/1.1\r\nhost: {host}\r\n{headers}"
    if body:
        head += f"content-type: application/json\r\ncontent-length: {len(body)}\r\n"
    return head.encode() + b"\r\n" + body


async def closed_loop(
    concurrency: int, duration_s: float, op: Callable[[int, int], object]
) -> tuple[int, float]:
    """Run ``op(worker, i)`` coroutines back to back on ``concurrency`` workers."""
    stop = time.perf_counter() + duration_s
    count = 0

    async def worker(w: int) -> None:
        nonlocal count
        i = 0
        while time.perf_counter() < stop:
            await op(w, i)  # type: ignore[misc]
            i += 1
            count += 1

    started = time.perf_counter()
    await asyncio.gather(*(worker(w) for w in range(concurrency)))
    return count, time.perf_counter() - started


async def open_loop(
    rate: float, duration_s: float, concurrency: int, op: Callable[[int, int], object]
) -> int:
    """Fire ``op`` at a fixed total ``rate``/s spread over ``concurrency`` workers."""
    per_worker = rate / concurrency
    start = time.perf_counter()
    total = 0

    async def worker(w: int) -> None:
        nonlocal total
        n = int(per_worker * duration_s)
        offset = w / rate
        for i in range(n):
            due = start + offset + i / per_worker
            delay = due - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            await op(w, i)  # type: ignore[misc]
            total += 1

    await asyncio.gather(*(worker(w) for w in range(concurrency)))
    return total
