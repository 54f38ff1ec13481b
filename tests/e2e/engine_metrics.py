"""Read a vLLM server's Prometheus metrics: running/waiting requests, KV-cache usage, prompt
tokens by where their KV came from, and the pdgate connector's series; how long engines take to
be idle again."""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Mapping

import httpx
from prometheus_client.parser import text_string_to_metric_families


async def metrics_text(url: str) -> str:
    async with httpx.AsyncClient(timeout=10) as http:
        return (await http.get(url + "/metrics")).text


async def samples(url: str) -> dict[str, float]:
    """A process's samples, keyed ``name`` or ``name{label values}`` (the values in the order
    the exposition gives them: sorted by label name for pdgate's own series)."""
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(await metrics_text(url)):
        for s in family.samples:
            own = ",".join(s.labels.values())
            key = f"{s.name}{{{own}}}" if own else s.name
            out[key] = out.get(key, 0.0) + s.value
    return out


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
    return _gauges_of(await metrics_text(url))


def _gauges_of(text: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for line in text.splitlines():
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
        if _is_idle(g, math.inf if kv_level is None else kv_level):
            return g
        if time.monotonic() > deadline:
            raise AssertionError(f"{url} not idle after {timeout_s}s: {g}")
        await asyncio.sleep(0.25)


def _is_idle(g: dict[str, float], kv_level: float) -> bool:
    return (
        g.get("vllm:num_requests_running", 0) == 0
        and g.get("vllm:num_requests_waiting", 0) == 0
        and g.get("vllm:kv_cache_usage_perc", 0) <= kv_level + 1e-9
    )


# vLLM counts freed blocks that stay in the prefix cache as free (and leaves out its null
# block): an idle engine reads exactly 0 (vllm/v1/core/block_pool.py, BlockPool.get_usage)
IDLE_KV = 0.0


async def wait_all_idle(urls: Mapping[str, str], timeout_s: float = 60) -> None:
    """Every engine idle, KV usage included: the state a scenario starts from."""
    await asyncio.gather(*(wait_idle(url, timeout_s, kv_level=IDLE_KV) for url in urls.values()))


async def seconds_until_idle(
    urls: Mapping[str, str], since: float, timeout_s: float
) -> dict[str, float]:
    """Per engine: seconds from ``since`` (a ``time.monotonic()`` reading, e.g. the fault)
    until the engine first reads idle — nothing running or waiting and KV usage back to
    ``IDLE_KV``; ``math.inf`` for one still busy ``timeout_s`` after ``since``. All
    engines are polled side by side every 0.1 s; one that does not answer (stopped by SIGSTOP,
    dead) counts as busy."""
    deadline = since + timeout_s
    out: dict[str, float] = {}
    async with httpx.AsyncClient(timeout=1.0) as http:

        async def one(name: str, url: str) -> None:
            while time.monotonic() < deadline:
                t = time.monotonic()
                try:
                    g = _gauges_of((await http.get(url + "/metrics")).text)
                except httpx.HTTPError:
                    g = None
                if g is not None and _is_idle(g, IDLE_KV):
                    out[name] = max(0.0, t - since)
                    return
                await asyncio.sleep(0.1)
            out[name] = math.inf

        await asyncio.gather(*(one(n, u) for n, u in urls.items()))
    return out


async def connector_series(url: str, model: str | None = None) -> dict[str, float]:
    """Every ``vllm:pdgate_*`` sample but the histogram buckets, summed over vLLM's ``engine``
    label; a sample with a label of its own is keyed ``name{value}``
    (``vllm:pdgate_transfers_total{ok}``). With ``model``, every sample must carry it as
    ``model_name``."""
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(await metrics_text(url)):
        for sample in family.samples:
            name = sample.name
            if not name.startswith("vllm:pdgate_") or name.endswith(("_created", "_bucket")):
                continue
            labels = dict(sample.labels)
            if model is not None:
                assert labels.get("model_name") == model, sample
            own = [v for k, v in labels.items() if k not in ("model_name", "engine")]
            key = f"{name}{{{','.join(own)}}}" if own else name
            out[key] = out.get(key, 0.0) + sample.value
    return out


async def series_names(url: str) -> set[str]:
    """The name of every sample on ``url``'s ``/metrics``."""
    text = await metrics_text(url)
    return {s.name for f in text_string_to_metric_families(text) for s in f.samples}
