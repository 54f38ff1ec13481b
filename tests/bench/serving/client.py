"""The serving bench's load generator: each request sent at its arrival time (open loop, however
the system keeps up), streamed, every chunk's arrival timed.

A ``Result`` holds what the client saw: the status, the time to the first content chunk, the gaps
between content chunks (vLLM streams one token per chunk: the inter-token latencies), the whole
answer's time and its token count (``usage``). A request that fails is kept with its error."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import httpx

from tests.bench.serving.workload import Req


@dataclass
class Result:
    req: Req
    sent_s: float = 0.0  # after the run's start (late when the client itself lagged)
    ttft_s: float | None = None
    gaps_s: list[float] = field(default_factory=list)
    total_s: float | None = None
    tokens: int = 0
    error: str = ""

    @property
    def ok(self) -> bool:
        return not self.error and self.ttft_s is not None

    def mean_itl(self) -> float | None:
        return sum(self.gaps_s) / len(self.gaps_s) if self.gaps_s else None


def body(model: str, r: Req) -> dict[str, Any]:
    return {
        "model": model,
        "prompt": r.prompt,
        "max_tokens": r.max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }


async def one(http: httpx.AsyncClient, url: str, model: str, r: Req, start: float) -> Result:
    loop = asyncio.get_running_loop()
    await asyncio.sleep(max(0.0, start + r.at_s - loop.time()))
    out = Result(r, sent_s=loop.time() - start)
    t0 = time.perf_counter()
    last: float | None = None
    try:
        async with http.stream("POST", url + "/v1/completions", json=body(model, r)) as resp:
            if resp.status_code != 200:
                text = (await resp.aread()).decode(errors="replace")[:200]
                out.error = f"HTTP {resp.status_code}: {text}"
                return out
            async for line in resp.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                event = json.loads(data)
                if "error" in event:
                    out.error = f"stream error: {json.dumps(event['error'])[:200]}"
                    return out
                usage = event.get("usage")
                if usage:
                    out.tokens = int(usage.get("completion_tokens") or 0)
                if not any(c.get("text") for c in event.get("choices") or ()):
                    continue
                now = time.perf_counter()
                if last is None:
                    out.ttft_s = now - t0
                else:
                    out.gaps_s.append(now - last)
                last = now
        out.total_s = time.perf_counter() - t0
    except (httpx.HTTPError, ValueError) as exc:
        out.error = f"{type(exc).__name__}: {exc}"
    return out


async def run(url: str, model: str, reqs: Sequence[Req], timeout_s: float) -> list[Result]:
    """Send every request at its arrival time; wait for all of them."""
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=64)
    async with httpx.AsyncClient(timeout=timeout_s, limits=limits) as http:
        start = asyncio.get_running_loop().time() + 0.5
        return list(await asyncio.gather(*(one(http, url, model, r, start) for r in reqs)))
