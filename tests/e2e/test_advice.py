"""The TTFT breakdown and the P:D advice on real engines (the shared 2P2D deployment, its proxy
posting first_token marks): long prompts all at once starve P, and the breakdown names a P
stage and the advice grows P; then many short streams load D, and it names a D stage and
grows D. Each phase reads only its own window."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import httpx
import pytest

from metaserver.breakdown import DECODE_STAGES, PREFILL_STAGES
from tests.e2e.client import client, complete
from tests.e2e.conftest import Engines
from tests.e2e.test_equality import prompt_ids

pytestmark = pytest.mark.e2e


async def breakdown(engines: Engines, since: float, target: float | None = None) -> Any:
    params: dict[str, float] = {"window": time.time() - since + 1}
    if target is not None:
        params["ttft_p90"] = target
    async with httpx.AsyncClient(base_url=engines.pd.metaserver, timeout=30) as ms:
        r = await ms.get("/v1/breakdown", params=params)
    assert r.status_code == 200, r.text
    return r.json()


async def load(engines: Engines, prompts: list[list[int]], max_tokens: int) -> None:
    c = client(engines.pd.proxy)
    answers = await asyncio.gather(
        *(complete(c, engines.model, p, max_tokens=max_tokens) for p in prompts)
    )
    assert all(a.token_ids for a in answers)  # each answered (a random model may stop early)


async def test_e2e_breakdown_and_advice_follow_the_starved_pool(engines: Engines) -> None:
    since = time.time()
    await load(engines, [prompt_ids(1500, seed=900 + i) for i in range(8)], max_tokens=1)
    now = await breakdown(engines, since)
    assert now["transfers"] == 8 and now["missing_stages"] == [], now
    assert now["bottleneck"] in PREFILL_STAGES, now
    p_starved = await breakdown(engines, since, target=now["ttft"]["p90_s"] / 2)
    advice = p_starved["advice"]
    print(f"P starved: {advice['reasoning']}")
    assert advice["now"] == {"prefill": 2, "decode": 2}
    assert advice["recommended"]["prefill"] > 2, advice

    since = time.time()
    await load(engines, [prompt_ids(16, seed=950 + i) for i in range(32)], max_tokens=48)
    now = await breakdown(engines, since)
    assert now["transfers"] == 32, now
    assert now["bottleneck"] in DECODE_STAGES, now
    d_starved = await breakdown(engines, since, target=now["ttft"]["p90_s"] / 2)
    advice = d_starved["advice"]
    print(f"D loaded: {advice['reasoning']}")
    assert advice["recommended"]["decode"] > 2, advice
