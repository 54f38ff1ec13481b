"""Flows and placement on the 2P+2D deployment: concurrent mode, direct, requests spread over
all four engines, and each request's binding history in the metaserver."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from tests.e2e.client import client, complete
from tests.e2e.conftest import Engines
from tests.e2e.observe import observer
from tests.e2e.test_equality import assert_same, latest_binding, prompt_ids

pytestmark = pytest.mark.e2e


@pytest.mark.parametrize("flow", ["concurrent", "decode-first", "direct"])
async def test_e2e_flow_equals_monolithic(engines: Engines, flow: str) -> None:
    prompt = prompt_ids(150, seed={"concurrent": 11, "decode-first": 12, "direct": 13}[flow])
    ref = await complete(client(engines.mono_url), engines.model, prompt)
    got = await complete(
        client(engines.pd.proxy), engines.model, prompt, headers={"x-pd-flow": flow}
    )
    assert_same(got, ref)
    if flow != "direct":
        b = await latest_binding(engines)
        assert b["num_prompt_tokens"] == 150 and b["state"] == "done"


async def test_e2e_binding_history_is_inspectable(engines: Engines) -> None:
    prompt = prompt_ids(200, seed=21)
    answer = await client(engines.pd.proxy).completions.create(
        model=engines.model, prompt=prompt, max_tokens=4, temperature=0
    )
    b = await latest_binding(engines)
    # the answer's id names the engines' request, never the transfer
    assert b["transfer_id"] not in answer.id and answer.id.startswith("cmpl-pdr-")
    assert answer.id.removeprefix("cmpl-") in b["request_id"]
    events = b["events"]
    assert isinstance(events, list)
    states = [e["state"] for e in events]
    assert states[0] == "bound" and states[-1] == "done"
    actors = {e["state"]: e["actor"] for e in events}
    assert actors["bound"] == b["decode_instance_id"]
    assert str(actors["done"]).startswith("prefill-")  # the P instance that pushed
    assert all(events[i]["at"] <= events[i + 1]["at"] for i in range(len(events) - 1))
    assert b["block_ids"] and b["block_size"] == 32


async def test_e2e_requests_spread_over_all_four_engines(engines: Engines) -> None:
    async with observer(engines.pd.proxy, 10) as px:
        before = (await px.get("/v1/instances")).json()
    assert before["inflight"] == 0 and all(i["inflight"] == 0 for i in before["instances"]), before
    assert all(i["healthy"] and i["circuit"] == "closed" for i in before["instances"]), before
    pd = client(engines.pd.proxy)
    prompts = [prompt_ids(60 + i, seed=300 + i) for i in range(12)]
    await asyncio.gather(*(complete(pd, engines.model, p, max_tokens=2) for p in prompts))
    async with observer(engines.pd.metaserver, 10) as ms:
        bindings = (await ms.get("/v1/bindings", params={"limit": 12})).json()["bindings"]
    decoders = {b["decode_instance_id"] for b in bindings}
    prefillers = {e["actor"] for b in bindings for e in b["events"] if e["state"] != "bound"}
    assert decoders == {"decode-0", "decode-1"}, before
    assert {"prefill-0", "prefill-1"} <= prefillers


async def test_e2e_prefill_given_a_forged_binding_pushes_nothing_and_says_so(
    engines: Engines,
) -> None:
    prompt = prompt_ids(80, seed=41)
    await complete(client(engines.pd.proxy), engines.model, prompt, max_tokens=2)
    real = await latest_binding(engines)
    tid = "forged-e2e-1"
    forged = {**real, "transfer_id": tid, "kv_endpoint": {"host": "10.6.6.6", "port": 5600}}
    kv = {"do_remote_decode": True, "transfer_id": tid, "decode": forged}
    body = {"model": engines.model, "prompt": prompt, "max_tokens": 1, "kv_transfer_params": kv}
    async with httpx.AsyncClient(base_url=engines.pd.url_of("prefill-0"), timeout=120) as p:
        # straight to P, past the proxy: without the engines' API key, refused outright ...
        assert (await p.post("/v1/completions", json=body)).status_code == 401
        # ... and with it (someone holding the proxy's key), P still pushes nothing
        key = {"authorization": f"Bearer {engines.pd.plan.options.engine_api_key}"}
        r = await p.post("/v1/completions", json=body, headers=key)
    assert r.status_code == 200, r.text
    # vLLM hands the connector's report back in the answer: nothing was pushed, and why
    assert r.json()["kv_transfer_params"] == {
        "transfer_id": tid,
        "push": "none",
        "reason": f"the registry does not vouch for {real['decode_instance_id']} at 10.6.6.6:5600",
    }
