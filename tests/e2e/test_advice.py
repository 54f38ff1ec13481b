"""The TTFT breakdown and the P:D advice on real engines (the shared 2P2D deployment, its proxy
posting first_token marks): long prompts all at once starve P, and the breakdown names a P
stage and the advice grows P alone; then many short streams load D, and it names a D stage and
grows D, not P, for a TTFT target; many streams at once slow every stream's tokens, and for an
inter-token latency target it grows D and keeps only the P it needs. Each phase reads only its
own window.

The TTFT targets are a quarter below the window's p90: by the model
(``metaserver/capacity/advice.py``, docs/operating.md) the starved pool alone then meets them with
one instance or two more, so advice that also grows the other pool is wrong. (At half the p90, P
alone reaches the P phase's target only if P's wait is over half its p90: the recorded run had
54%, and D's stages would then be grown by the model too.)

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

from metaserver.capacity.advice import BUSY_CAP
from metaserver.capacity.breakdown import DECODE_STAGES, PREFILL_STAGES
from tests.e2e.client import client, complete
from tests.e2e.conftest import Engines
from tests.e2e.observe import observer
from tests.e2e.test_equality import prompt_ids

pytestmark = pytest.mark.e2e

D_TOKENS = 256  # each answer of the D phase (not streamed): D's load, not P's, sets its TTFT


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
    p_starved = await breakdown(engines, since, target=now["ttft"]["p90_s"] * 3 / 4)
    advice = p_starved["advice"]
    print(f"P starved: {advice['reasoning']}")
    await record(engines, "p_starved", since, p_starved)
    assert advice["now"] == {"prefill": 2, "decode": 2}
    # 8 at once, 4 interleaved on each P: P's wait is most of each TTFT (15.1 s of a 27.9 s p90
    # recorded), so one P more takes off the quarter (3 P: 14.6 s against 21.0 s; the recorded
    # test pins the exact count); one D more only takes a third of D's load above its floor
    assert advice["recommended"]["prefill"] > 2, advice
    assert advice["recommended"]["decode"] <= 2, advice

    quiet = time.time()
    for i in range(2):  # a quiet D first: the floor the advice looks back for
        await load(engines, [prompt_ids(16, seed=940 + i)], max_tokens=48, stream=True)
    await asyncio.sleep(1)  # their end marks are posted after the answers
    await record(engines, "d_quiet", quiet, None)

    # not streamed: each "first token" is D's whole answer, so D's load shows in its stages.
    # 32 at once also queue at P (0.35-0.75 s of waiting measured), and one P more takes all
    # of that off in the model: answers of 48 tokens (0.75-1.7 s of D's load) let P alone meet
    # the target or share it (3P2D advised on an idle machine). 256 make D's load several times
    # P's wait.
    since = time.time()
    await load(engines, [prompt_ids(16, seed=950 + i) for i in range(32)], max_tokens=D_TOKENS)
    now = await breakdown(engines, since)
    assert now["transfers"] == 32, now
    assert now["bottleneck"] in DECODE_STAGES, now
    d_starved = await breakdown(engines, since, target=now["ttft"]["p90_s"] * 3 / 4)
    advice = d_starved["advice"]
    print(f"D loaded: {advice['reasoning']}")
    await record(engines, "d_loaded", since, d_starved)
    assert advice["now"] == {"prefill": 2, "decode": 2}
    # The p90 is about P's stages (~1 s) plus D's load L above its floor (the quiet streams):
    # a quarter of it is over P's wait once L is over 3x that wait, so one P more no longer
    # meets the target; 3 D take off L/3, 4 D L/2, which does; a P more and a D more, as few
    # instances as 4 D, make two changes. P may shrink (under 80% busy), never grow.
    assert advice["recommended"]["decode"] > 2, advice
    assert advice["recommended"]["prefill"] <= 2, advice

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
    assert advice["now"] == {"prefill": 2, "decode": 2}
    assert advice["recommended"]["decode"] > 2, advice
    # P does not move ITL and no TTFT is asked: the fewest P that stay under BUSY_CAP each
    # (16-token prompts: 14% busy each recorded)
    one_p = advice["prefill_busy"] * 2 < BUSY_CAP
    assert advice["recommended"]["prefill"] == (1 if one_p else 2), advice
