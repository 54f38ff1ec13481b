"""Read a vLLM server's Prometheus metrics: running/waiting requests, KV-cache usage, and
prompt tokens by where their KV came from."""

from __future__ import annotations

import asyncio
import time

import httpx


async def metrics_text(url: str) -> str:
    async with httpx.AsyncClient(timeout=10) as http:
        return (await http.get(url + "/metrics")).text


async def prompt_tokens_by_source(url: str) -> dict[str, float]:
    """``vllm:prompt_tokens_by_source_total`` summed per source: local_compute,
    local_cache_hit, external_kv_transfer."""
    out: dict[str, float] = {}
    for line in (await metrics_text(url)).splitlines():
        if line.startswith("vllm:prompt_tokens_by_source_total{"):
            source = line.split('source="', 1)[1].split('"', 1)[0]
            out[source] = out.get(source, 0.0) + float(line.rsplit(" ", 1)[1])
    return out


async def gauges(url: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for line in (await metrics_text(url)).splitlines():
        if line.startswith("#"):
            continue
        for name in ("vllm:num_requests_running", "vllm:num_requests_waiting",
                     "vllm:kv_cache_usage_perc"):  # fmt: skip
            if line.startswith((name + "{", name + " ")):
                out[name] = out.get(name, 0.0) + float(line.rsplit(" ", 1)[1])
    return out


async def wait_idle(url: str, timeout_s: float, kv_level: float | None = None) -> dict[str, float]:
    """Poll until nothing runs or waits (and KV usage is back to ``kv_level``); return the last
    reading. Raises AssertionError with that reading when the deadline passes."""
    deadline = time.monotonic() + timeout_s
    while True:
        g = await gauges(url)
        idle = (
            g.get("vllm:num_requests_running", 0) == 0
            and g.get("vllm:num_requests_waiting", 0) == 0
        )
        if idle and (kv_level is None or g.get("vllm:kv_cache_usage_perc", 0) <= kv_level + 1e-9):
            return g
        if time.monotonic() > deadline:
            raise AssertionError(f"{url} not idle after {timeout_s}s: {g}")
        await asyncio.sleep(0.25)
