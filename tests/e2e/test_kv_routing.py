"""KV-event routing on real engines: the shared 2P2D deployment's engines publish vLLM's KV
events and its metaserver (on Redis) indexes them; a proxy of this module's own routes with the
``kv`` policy. The index's entries for a prompt are exactly the block keys pdgate computes for
it (any difference in algorithm, seed or block size would match nothing), and requests sharing
a prefix go to the prefill instance whose cache holds it, as the engines' events say: each one
sent only once the memory of where the last went (the metaserver's ``--kv-placed``:
``KV_PLACED_S`` here) has lapsed."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from typing import Any

import pytest

from pdwire.block_hash import BlockHasher
from tests.e2e.client import client, complete
from tests.e2e.conftest import LOG_DIR, Engines
from tests.e2e.engine_metrics import prompt_tokens_by_source, samples
from tests.e2e.observe import observer
from tests.e2e.stack import BLOCK_SIZE, KV_PLACED_S, own_proxy
from tests.e2e.test_equality import prompt_ids

pytestmark = pytest.mark.e2e
INDEXED_WITHIN_S = 30.0  # events reach the index in well under a second; a loaded CI is slower
# after an answer, until the memory of its choice has lapsed: the metaserver's counts from the
# placement, sent at the choice (in the background: the margin)
LAPSED_AFTER_S = KV_PLACED_S + 0.5


@pytest.fixture(scope="module")
def kv_proxy(engines: Engines) -> Iterator[str]:
    model = str(engines.pd.plan.options.model)
    kv = ("--prefill-policy", "kv", "--decode-policy", "kv", "--tokenizer", model)
    with own_proxy(engines.pd, "proxy-kv", kv, LOG_DIR / "kv-routing") as url:
        yield url


async def index_state(engines: Engines) -> Any:
    async with observer(engines.pd.metaserver) as ms:
        r = await ms.get("/v1/kv")
    assert r.status_code == 200, r.text
    return r.json()


async def matched(
    engines: Engines, ids: list[int], instances: list[str], placed: bool = False
) -> dict[str, int]:
    """Per instance, the leading blocks of ``ids`` the index holds by the engines' events (and,
    with ``placed``, by the proxies' placements, as the proxy asks)."""
    keys = BlockHasher(BLOCK_SIZE).keys(ids)
    async with observer(engines.pd.metaserver) as ms:
        body = {"keys": keys, "instances": instances, "placed": placed}
        r = await ms.post("/v1/kv/match", json=body)
    assert r.status_code == 200, r.text
    got: dict[str, int] = r.json()["matched"]
    return got


async def instance_ids(engines: Engines) -> dict[str, list[str]]:
    async with observer(engines.pd.metaserver) as ms:
        listed = (await ms.get("/v1/instances")).json()
    items = listed["instances"] if isinstance(listed, dict) else listed
    out: dict[str, list[str]] = {"prefill": [], "decode": []}
    for inst in items:
        out[inst["role"]].append(inst["instance_id"])
    return out


async def until_indexed(
    engines: Engines, ids: list[int], instances: list[str], blocks: int
) -> dict[str, int]:
    deadline = time.monotonic() + INDEXED_WITHIN_S
    while True:
        got = await matched(engines, ids, instances)
        if max(got.values()) >= blocks or time.monotonic() > deadline:
            return got
        await asyncio.sleep(0.2)


async def test_e2e_index_holds_exactly_the_keys_pdgate_computes(
    engines: Engines, kv_proxy: str
) -> None:
    state = await index_state(engines)
    assert state["following"] is True, state
    roles = await instance_ids(engines)
    assert len(roles["prefill"]) == 2 and len(roles["decode"]) == 2, roles
    deadline = time.monotonic() + INDEXED_WITHIN_S
    while len(state["streams"]) < 4 and time.monotonic() < deadline:
        await asyncio.sleep(0.5)
        state = await index_state(engines)
    assert sorted(state["streams"]) == sorted(roles["prefill"] + roles["decode"]), state

    ids = prompt_ids(700, seed=4100)  # 21 full blocks of 32 and 28 tokens more
    answer = await complete(client(kv_proxy), engines.model, ids, max_tokens=2)
    assert len(answer.token_ids) >= 1
    p = await until_indexed(engines, ids, roles["prefill"], 21)
    d = await until_indexed(engines, ids, roles["decode"], 21)
    # one P computed the prompt and one D received it: each caches its 21 full blocks, under
    # the keys pdgate computed on its own (a different hash would match nothing at all)
    assert sorted(p.values()) == [0, 21], p
    assert sorted(d.values()) == [0, 21], d


async def place(engines: Engines, instance: str, ids: list[int]) -> None:
    """What a proxy does once it has chosen: ``ids``' blocks count as held on ``instance``."""
    body = {"placed": [{"instance": instance, "keys": BlockHasher(BLOCK_SIZE).keys(ids)}]}
    async with observer(engines.pd.metaserver) as ms:
        r = await ms.post("/v1/kv/placed", json=body)
    assert r.status_code == 204, r.text


async def until_lapsed(answered: float) -> None:
    await asyncio.sleep(max(0.0, answered + LAPSED_AFTER_S - time.monotonic()))


async def test_e2e_a_shared_prefix_goes_where_it_is_cached(engines: Engines, kv_proxy: str) -> None:
    """Each follow-up is chosen after the memories of the choices before it lapsed: only the
    engines' events can send it to the P holding the prefix (the proxy's ``least_load``
    tie-break, which it would fall back on, prefers the P that computed least lately)."""
    roles = await instance_ids(engines)
    prefix = prompt_ids(640, seed=4200)  # 20 blocks
    c = client(kv_proxy)
    first = await complete(c, engines.model, prefix + prompt_ids(96, seed=4201), max_tokens=1)
    answered = time.monotonic()
    assert len(first.token_ids) == 1
    got = await until_indexed(engines, prefix, roles["prefill"], 20)
    assert sorted(got.values()) == [0, 20], got
    holder = next(iid for iid, n in got.items() if n == 20)
    other = next(iid for iid in got if iid != holder)
    urls = {name: engines.pd.url_of(name) for name in ("prefill-0", "prefill-1")}
    assert holder in urls and other in urls, (holder, urls)  # instance ids are the names
    # a placement of the prefix on the other P (whose cache holds none of it), as a proxy's:
    # it counts as held there, then lapses before the first follow-up (it would draw it there)
    probe = prefix + prompt_ids(64, seed=4202)
    sent = time.monotonic()
    await place(engines, other, probe)
    placed = time.monotonic()
    counted = (await matched(engines, probe, [other], placed=True))[other]
    if time.monotonic() - sent < KV_PLACED_S:  # else the machine stalled: this says nothing
        assert counted == 22, counted
    before = {name: await prompt_tokens_by_source(url) for name, url in urls.items()}
    for i in range(3):  # one after another: each P is idle when the next is chosen
        await until_lapsed(max(answered, placed))
        # what the proxy will be told is the engines' events alone: every placement lapsed
        events = await matched(engines, prefix, roles["prefill"])
        told = await matched(engines, prefix, roles["prefill"], placed=True)
        assert told == events and events[holder] == 20, (told, events)
        a = await complete(c, engines.model, prefix + prompt_ids(96, seed=4210 + i), max_tokens=1)
        answered = time.monotonic()
        assert len(a.token_ids) == 1
    after = {name: await prompt_tokens_by_source(url) for name, url in urls.items()}
    hits = {
        name: after[name].get("local_cache_hit", 0) - before[name].get("local_cache_hit", 0)
        for name in urls
    }
    computed = {
        name: after[name].get("local_compute", 0) - before[name].get("local_compute", 0)
        for name in urls
    }
    print(f"P cache hits {hits}, computed {computed} (holder {holder})")
    # every follow-up went to the P whose events hold the prefix: 3 x 640 tokens from its
    # cache, and the other P computed nothing (least_load would have alternated between two
    # idle Ps)
    assert hits == {holder: 3 * 640, other: 0}, hits
    assert computed == {holder: 3 * 96, other: 0}, computed
    lookups = {
        k: v for k, v in (await samples(kv_proxy)).items() if k.startswith("pd_kv_lookups_total")
    }
    assert lookups.get("pd_kv_lookups_total{matched}", 0) >= 3, lookups
