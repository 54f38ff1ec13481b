"""The TTFT breakdown and the P:D advice on real engines (the shared 2P2D deployment, its proxy
posting first_token marks): long prompts all at once starve P, and the breakdown names a P
stage and the advice grows P; then many short streams load D, and it names a D stage and
grows D for a TTFT target; many streams at once slow every stream's tokens, and for an
inter-token latency target it grows D. Each phase reads only its
own window.

With ``PDGATE_RECORD_TIMELINES=DIR`` each phase's finished bindings are written to
``DIR/advice_<phase>.json``: the recorded timelines ``tests/metaserver/test_advice_recorded.py``
reads (``tests/metaserver/data/``)."""

from __future__ import annotations

import asyncio
import json
import os
import time
from pathlib import Path
from typing import Any

import pytest

from metaserver.breakdown import DECODE_STAGES, PREFILL_STAGES
from tests.e2e.client import client, complete
from tests.e2e.conftest import Engines
from tests.e2e.observe import observer
from tests.e2e.test_equality import prompt_ids

pytestmark = pytest.mark.e2e


async def breakdown(
    engines: Engines, since: float, target: float | None = None, itl: float | None = None
) -> Any:
    params: dict[str, float] = {"window": time.time() - since + 1}
    if target is not None:
        params["ttft_p90"] = target
    if itl is not None:
        params["itl_p90"] = itl
    async with observer(engines.pd.metaserver, 30) as ms:
        r = await ms.get("/v1/breakdown", params=params)
    assert r.status_code == 200, r.text
    return r.json()


async def record(engines: Engines, phase: str, since: float, got: Any | None) -> None:
    """The phase's finished bindings, as the metaserver lists them, for the recorded tests."""
    into = os.environ.get("PDGATE_RECORD_TIMELINES")
    if not into:
        return
    async with observer(engines.pd.metaserver, 30) as ms:
        r = await ms.get("/v1/bindings", params={"state": "done", "limit": 1000})
    bindings = [b for b in r.json()["bindings"] if b["updated_at"] >= since]
    out = {"window_s": got["window_s"], "pools": got["advice"]["now"]} if got else {}
    out["bindings"] = bindings
    _write(Path(into, f"advice_{phase}.json"), out)


def _write(path: Path, data: Any) -> None:
    path.write_text(json.dumps(data, indent=1) + "\n")


async def load(
    engines: Engines, prompts: list[list[int]], max_tokens: int, stream: bool = False
) -> None:
    c = client(engines.pd.proxy)
    answers = await asyncio.gather(
        *(complete(c, engines.model, p, max_tokens=max_tokens, stream=stream) for p in prompts)
    )
    assert all(a.token_ids for a in answers)  # each answered (a random model may stop early)


async def test_e2e_breakdown_and_advice_follow_the_starved_pool(engines: Engines) -> None:
    # This module is the first to use the deployment: one long prompt per P first, outside
    # every window. A fresh-clone run saw the P phase's pushes start ~50 s after D took the
    # requests, past D's 60 s load deadline, with no machine pause measured.
    await load(engines, [prompt_ids(1500, seed=890 + i) for i in range(2)], max_tokens=1)
    await asyncio.sleep(1.5)  # past the 1 s the windows below reach back
    since = time.time()
    await load(engines, [prompt_ids(1500, seed=900 + i) for i in range(8)], max_tokens=1)
    now = await breakdown(engines, since)
    assert now["transfers"] == 8 and now["missing_stages"] == [], now
    assert now["bottleneck"] in PREFILL_STAGES, now
    p_starved = await breakdown(engines, since, target=now["ttft"]["p90_s"] / 2)
    advice = p_starved["advice"]
    print(f"P starved: {advice['reasoning']}")
    await record(engines, "p_starved", since, p_starved)
    assert advice["now"] == {"prefill": 2, "decode": 2}
    assert advice["recommended"]["prefill"] > 2, advice

    quiet = time.time()
    for i in range(2):  # a quiet D first: the floor the advice looks back for
        await load(engines, [prompt_ids(16, seed=940 + i)], max_tokens=48, stream=True)
    await asyncio.sleep(1)  # their end marks are posted after the answers
    await record(engines, "d_quiet", quiet, None)

    # not streamed: each "first token" is D's whole answer, so D's load shows in its stages
    since = time.time()
    await load(engines, [prompt_ids(16, seed=950 + i) for i in range(32)], max_tokens=48)
    now = await breakdown(engines, since)
    assert now["transfers"] == 32, now
    assert now["bottleneck"] in DECODE_STAGES, now
    d_starved = await breakdown(engines, since, target=now["ttft"]["p90_s"] / 2)
    advice = d_starved["advice"]
    print(f"D loaded: {advice['reasoning']}")
    await record(engines, "d_loaded", since, d_starved)
    assert advice["recommended"]["decode"] > 2, advice

    # streamed: every stream's tokens come slower than a lone stream's
    since = time.time()
    await load(engines, [prompt_ids(16, seed=980 + i) for i in range(32)], 48, stream=True)
    await asyncio.sleep(1)  # the end marks
    now = await breakdown(engines, since)
    assert now["itl"] is not None and now["itl"]["count"] > 16, now
    itl_starved = await breakdown(engines, since, itl=now["itl"]["p90_s"] / 2)
    advice = itl_starved["advice"]
    print(f"D streaming, ITL target: {advice['reasoning']}")
    await record(engines, "d_streams", since, itl_starved)
    assert advice["recommended"]["decode"] > 2, advice
