"""The only prefill instance killed while it pushes: the client still gets the monolithic
engine's answer within seconds. The proxy sees P's connection break before D's first byte,
reads that P had taken the binding, drops D's first request and sends D the plain one: D
computes the prompt itself (a retry would find no live P). D is left with nothing running or
held, and the binding is closed.

(With a second P the same happens: tests/e2e/test_chaos.py.)"""

from __future__ import annotations

import asyncio
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.e2e.client import client, complete
from tests.e2e.conftest import LOG_DIR, Monolithic
from tests.e2e.engine_metrics import wait_idle
from tests.e2e.stack import Deployment, base_options, deployment, running
from tests.e2e.test_equality import assert_same, prompt_ids

pytestmark = pytest.mark.e2e
KV_LOAD_TIMEOUT_S = 8.0


@pytest.fixture(scope="module")
def fragile(tiny_model: Path) -> Iterator[Deployment]:
    """A 1P1D deployment of its own (its P gets killed), with a short KV-load deadline."""
    dep = deployment(
        base_options(tiny_model, kv_load_timeout_s=KV_LOAD_TIMEOUT_S), LOG_DIR / "fragile"
    )
    with running(dep, "the fragile deployment") as d:
        yield d


async def test_e2e_prefill_killed_mid_push(fragile: Deployment, monolithic: Monolithic) -> None:
    prompt = prompt_ids(1800, seed=99)  # ~33 chunks of 56 tokens: a long prefill to interrupt
    model = monolithic.model
    d_url = fragile.url_of("decode-0")
    request = asyncio.create_task(complete(client(fragile.proxy), model, prompt, max_tokens=8))
    started = time.monotonic()
    async with httpx.AsyncClient(base_url=fragile.metaserver, timeout=10) as ms:
        while True:  # kill P once it has started pushing this transfer
            assert time.monotonic() - started < 120, "prefill never started"
            if request.done():
                pytest.fail(f"request ended before P was killed: {request.result()!r}")
            bindings = (await ms.get("/v1/bindings", params={"limit": 1})).json()["bindings"]
            if bindings and bindings[0]["state"] in ("prefill_started", "pushing"):
                break
            await asyncio.sleep(0.02)
        p = fragile.supervisor.procs["prefill-0"]
        fragile.supervisor._signal(p, signal.SIGKILL)
        killed_at = time.monotonic()
        got = await asyncio.wait_for(request, KV_LOAD_TIMEOUT_S + 60)
        answered_after = time.monotonic() - killed_at
        ref = await complete(client(monolithic.url), model, prompt, max_tokens=8)
        # before the proxy let D compute, this was a 502: the retry found no live P
        assert_same(got, ref)
        print(f"\nanswer {answered_after:.1f}s after P was killed")
        # D holds the aborted load's blocks until its load deadline at the latest
        await wait_idle(d_url, KV_LOAD_TIMEOUT_S + 10, kv_level=0.0)
        final = (await ms.get(f"/v1/bindings/{bindings[0]['transfer_id']}")).json()
        # the proxy saw P's leg fail and marks it failed, or D's own abort of its dropped
        # first request landed first (protocol 3: D ends the binding of an aborted load)
        assert final["state"] in ("failed", "aborted"), final
        last = final["events"][-1]
        assert (last["state"], last["actor"]) in (("failed", "proxy"), ("aborted", "decode-0")), (
            last
        )
