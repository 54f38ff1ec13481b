"""A client that goes away mid-stream: within seconds neither engine runs its request and KV
usage is back to its idle level; the metaserver marks the transfer aborted or done."""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest

from tests.e2e.conftest import Engines
from tests.e2e.engine_metrics import gauges, wait_idle
from tests.e2e.observe import observer
from tests.e2e.test_equality import prompt_ids

pytestmark = pytest.mark.e2e


async def test_e2e_client_disconnect_frees_both_engines(engines: Engines) -> None:
    urls = [engines.pd.url_of(n) for n in ("prefill-0", "prefill-1", "decode-0", "decode-1")]
    for url in urls:
        await wait_idle(url, 60)
    kv_idle = {u: (await gauges(u)).get("vllm:kv_cache_usage_perc", 0.0) for u in urls}
    body = {
        "model": engines.model, "prompt": prompt_ids(300, seed=4242), "max_tokens": 1500,
        "temperature": 0, "stream": True, "ignore_eos": True,
    }  # fmt: skip
    async with httpx.AsyncClient(timeout=120) as http:
        async with http.stream("POST", engines.pd.proxy + "/v1/completions", json=body) as resp:
            assert resp.status_code == 200
            events = 0
            # keep the iterator referenced: an abandoned one is finalized by the event loop,
            # which can close the stream before the test means to (CI saw the request end early)
            lines = resp.aiter_lines()
            async for line in lines:
                if line.startswith("data: {"):
                    events += 1
                if events >= 5:
                    break
            deadline = time.monotonic() + 10
            while True:  # a D is decoding it now (the gauges follow the engine loop)
                running = [(await gauges(u)).get("vllm:num_requests_running", 0) for u in urls[2:]]
                if sum(running) >= 1:
                    break
                assert time.monotonic() < deadline, f"no decode instance runs it: {running}"
                await asyncio.sleep(0.1)
    closed_at = time.monotonic()  # leaving the block closed the connection mid-stream
    for url in urls:
        await wait_idle(url, 15, kv_level=kv_idle[url])
    assert time.monotonic() - closed_at < 15
    async with observer(engines.pd.metaserver, 10) as ms:
        latest = (await ms.get("/v1/bindings", params={"limit": 1})).json()["bindings"][0]
    # the push had finished before the client left (it saw tokens); the request was then dropped
    assert latest["num_prompt_tokens"] == 300
    assert latest["state"] in ("done", "aborted")
