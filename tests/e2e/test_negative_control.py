"""Negative control of the equality tests: with P's push deliberately corrupted (the test-only
``test_corrupt_push`` hook: garbage for the first block of layer 0), greedy output through P/D
differs from the monolithic engine — the equality check can see a wrong transfer. With
``verify_kv`` on as well, D's checksum check catches the corruption, fails the load, recomputes
(``kv_load_failure_policy=recompute``) and the answer is right again.

With the proxy's first-token check (on by default) the corruption is caught before D's answer
reaches the client: P's first token and D's differ, the pair is quarantined, D recomputes.

With a third prefill engine that serves the same model name from other weights (two revisions
side by side, as mid-way through a rolling update), no request is ever paired across them.

One deployment serves them all: two corrupting prefill engines, ``verify_kv`` off on prefill-0
and on on prefill-1 (the setting is P's: it decides what P's digests describe), prefill-2 of
the other weights, one decode engine, and two proxies taking the prefill engines in turn:
``proxy`` with the first-token check off (the equality check is the only judge),
``proxy-checked`` with it on. The first two tests send prompts until one went through the P
they are about, and judge every answer by the P that served it."""

from __future__ import annotations

import asyncio
import json
import shutil
import time
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import pytest

from launch.options import Child
from launch.plan import build_plan
from launch.tiny_model import RECIPE, make_model
from tests.e2e.client import Generation, client, complete
from tests.e2e.conftest import LOG_DIR, Monolithic
from tests.e2e.engine_metrics import samples
from tests.e2e.observe import newest_binding, observer
from tests.e2e.stack import (
    BLOCK_SIZE,
    PROXY_ARGS,
    READY_TIMEOUT_S,
    Deployment,
    base_options,
    deploy,
    own_proxy,
    running,
    with_port,
)
from tests.e2e.test_equality import assert_same, prompt_ids
from tests.support.procs import free_port

pytestmark = pytest.mark.e2e
PROMPT_TOKENS = 5 * BLOCK_SIZE + 9  # six blocks, four prefill chunks
HOOK_ON = "TEST HOOK test_corrupt_push IS ON"
MISMATCH = "does not match what P pushed"
UNCHECKED, CHECKED = "prefill-0", "prefill-1"  # verify_kv off, on
TRIES = 4  # round robin over the two Ps of decode-0's weights: each serves one of any two
CHECKING_PROXY = "proxy-checked"
OTHER_REVISION = "prefill-2"  # the same model name, other weights: never paired with decode-0


@pytest.fixture(scope="module")
def corrupting(tiny_model: Path) -> Iterator[Deployment]:
    logs = LOG_DIR / "corrupt"
    shutil.rmtree(logs, ignore_errors=True)
    other = make_model(tiny_model.parent, {**RECIPE, "seed": 4321}, "tiny-llama")
    opts = base_options(
        tiny_model,
        prefill=3,
        # landing_wait_s: a mismatch that persists 1 s is corruption, not bytes still landing
        extra_connector_config={"test_corrupt_push": True, "landing_wait_s": 1},
        extra_engine_env={"PDGATE_ALLOW_TEST_HOOKS": "1"},
        extra_proxy_args=(*PROXY_ARGS, "--prefill-policy", "round_robin"),
    )
    plan = build_plan(opts)
    proxy = plan.children[-1]
    assert proxy.name == "proxy"
    port = free_port()
    checked = with_port(replace(proxy, name=CHECKING_PROXY), port)
    plan.children[:] = [
        *(replace(c, argv=with_verify_kv(c.argv)) if c.name == CHECKED
          else other_revision(c, other) if c.name == OTHER_REVISION else c
          for c in plan.children[:-1]),
        replace(proxy, argv=[*proxy.argv, "--no-first-token-check"]),
        checked,
    ]  # fmt: skip
    with running(deploy(plan, logs), "the corrupting deployment") as d:
        yield d


def other_revision(engine: Child, weights: Path) -> Child:
    """``engine`` loading other weights under the same served model name (a checkpoint mid-way
    through a rolling update), without the corrupting hook."""
    argv = list(engine.argv)
    argv[argv.index("--model") + 1] = str(weights)
    at = argv.index("--kv-transfer-config") + 1
    config = json.loads(argv[at])
    del config["kv_connector_extra_config"]["test_corrupt_push"]
    argv[at] = json.dumps(config)
    return replace(engine, argv=argv)


def with_verify_kv(argv: list[str]) -> list[str]:
    """``argv`` with ``verify_kv`` turned on in its ``--kv-transfer-config``."""
    at = argv.index("--kv-transfer-config") + 1
    config = json.loads(argv[at])
    config["kv_connector_extra_config"]["verify_kv"] = True
    return [*argv[:at], json.dumps(config), *argv[at + 1 :]]


@dataclass
class Served:
    got: Generation
    ref: Generation
    binding: dict[str, Any]
    prefill: str  # the instance that pushed


async def through(dep: Deployment, mono: Monolithic, seed: int, proxy: str = "") -> Served:
    prompt = prompt_ids(PROMPT_TOKENS, seed=seed)
    ref = await complete(client(mono.ready()), mono.model, prompt)
    got = await complete(client(proxy or dep.proxy), mono.model, prompt)
    binding = await newest_binding(dep.metaserver)
    pushers = {e["actor"] for e in binding["events"] if e["state"] == "pushing"}
    assert len(pushers) == 1, binding["events"]
    return Served(got, ref, binding, pushers.pop())


def mismatches_of(dep: Deployment, transfer_id: str) -> list[str]:
    """D's log lines saying that what landed for ``transfer_id`` is not what P pushed."""
    return [
        line for line in dep.log_of("decode-0").splitlines()
        if MISMATCH in line and transfer_id in line
    ]  # fmt: skip


async def assert_unchecked(dep: Deployment, s: Served) -> None:
    """Without verify_kv nobody notices: D decodes from the corrupted KV."""
    assert len(s.ref.token_ids) == 16 and len(s.got.token_ids) == 16
    assert s.got.token_ids != s.ref.token_ids, "corrupted KV went unnoticed by the equality check"
    assert s.binding["state"] == "done"  # the push itself succeeded: D decoded from wrong KV
    assert s.binding["num_prompt_tokens"] == PROMPT_TOKENS
    assert mismatches_of(dep, str(s.binding["transfer_id"])) == []


async def assert_checked(dep: Deployment, s: Served) -> None:
    """With verify_kv D catches the corruption and recomputes: the answer is right."""
    assert_same(s.got, s.ref)
    assert s.binding["state"] == "done" and s.binding["num_prompt_tokens"] == PROMPT_TOKENS
    deadline = time.monotonic() + 10  # D's log is written by another process
    while not (mine := mismatches_of(dep, str(s.binding["transfer_id"]))):
        assert time.monotonic() < deadline, "D recomputed without logging the mismatch"
        await asyncio.sleep(0.2)
    assert len(mine) == 1, mine  # one transfer, caught once
    assert "layer model.layers.0." in mine[0]  # names where the bad block landed


async def until_served_by(dep: Deployment, mono: Monolithic, wanted: str, seed: int) -> None:
    """Prompts through P/D until ``wanted`` pushed one; every answer is judged by its P."""
    for attempt in range(TRIES):
        s = await through(dep, mono, seed + attempt)
        assert s.prefill in (UNCHECKED, CHECKED), s.prefill
        await (assert_unchecked if s.prefill == UNCHECKED else assert_checked)(dep, s)
        if s.prefill == wanted:
            assert HOOK_ON in dep.log_of(wanted)
            return
    pytest.fail(f"{wanted} pushed none of {TRIES} prompts (the proxy takes prefills in turn)")


async def test_e2e_corrupted_push_breaks_equality(
    corrupting: Deployment, monolithic: Monolithic
) -> None:
    await until_served_by(corrupting, monolithic, UNCHECKED, seed=4242)


async def test_e2e_verify_kv_catches_corrupted_push(
    corrupting: Deployment, monolithic: Monolithic
) -> None:
    await until_served_by(corrupting, monolithic, CHECKED, seed=4343)


async def test_e2e_first_token_check_keeps_corrupted_kv_from_the_client(
    corrupting: Deployment, monolithic: Monolithic
) -> None:
    """Through the proxy with the first-token check every greedy answer is right: the push from
    prefill-0 (no verify_kv) is caught at D's first token, the pair quarantined, D recomputes;
    from then on only prefill-1 is paired with decode-0 (its corruption caught by verify_kv)."""
    proxy = corrupting.url_of(CHECKING_PROXY)
    p0, d0 = corrupting.url_of(UNCHECKED), corrupting.url_of("decode-0")
    wrong = []
    for attempt in range(TRIES):
        prompt = prompt_ids(PROMPT_TOKENS, seed=4545 + attempt)
        ref = await complete(client(monolithic.ready()), monolithic.model, prompt)
        for stream in (False, True):
            got = await complete(client(proxy), monolithic.model, prompt, stream=stream)
            if got.token_ids != ref.token_ids:
                wrong.append((attempt, stream, got.token_ids[:4], ref.token_ids[:4]))
    metrics = await samples(proxy)
    pd = {k: v for k, v in metrics.items() if k.startswith(("pd_first", "pd_pair", "pd_decode_w"))}
    assert wrong == [], pd
    for attempt in range(TRIES):  # and the logprobs as well
        prompt = prompt_ids(PROMPT_TOKENS, seed=4545 + attempt)
        ref = await complete(client(monolithic.ready()), monolithic.model, prompt)
        assert_same(await complete(client(proxy), monolithic.model, prompt), ref)
    pair = f"{d0},{p0}"  # decode, prefill: the labels in the order the exposition sorts them
    assert metrics.get(f"pd_pair_mismatches_total{{{pair}}}") == 1.0, pd
    assert metrics.get(f"pd_pair_quarantined{{{pair}}}") == 1.0, pd
    assert metrics.get("pd_first_token_checks_total{mismatch}") == 1.0, pd
    assert "first tokens differ" in corrupting.log_of(CHECKING_PROXY)


async def test_e2e_other_weights_are_never_paired(
    corrupting: Deployment, monolithic: Monolithic
) -> None:
    """prefill-2 registered another model fingerprint than decode-0: no request reached it,
    every answer is right, and a restart of the proxy in the middle changes nothing (the proxy
    reads the registry before it serves)."""
    async with observer(corrupting.metaserver) as c:
        listed = (await c.get("/v1/instances")).json()
    by_url = {i["url"]: i for i in listed["instances"]}
    other, d0 = corrupting.url_of(OTHER_REVISION), corrupting.url_of("decode-0")
    assert by_url[other]["kv"]["model"] != by_url[d0]["kv"]["model"]
    assert by_url[corrupting.url_of(UNCHECKED)]["kv"]["model"] == by_url[d0]["kv"]["model"]

    proxy = corrupting.url_of(CHECKING_PROXY)
    for half in range(2):
        if half:  # restart the proxy, then straight back to work
            corrupting.supervisor.restart(CHECKING_PROXY)
            corrupting.supervisor.wait_ready(READY_TIMEOUT_S)
        for attempt in range(TRIES):
            prompt = prompt_ids(PROMPT_TOKENS, seed=4646 + 10 * half + attempt)
            ref = await complete(client(monolithic.ready()), monolithic.model, prompt)
            assert_same(await complete(client(proxy), monolithic.model, prompt), ref)
    finished = await samples(other)
    served = sum(v for k, v in finished.items() if k.startswith("vllm:request_success_total{"))
    assert served == 0, f"{OTHER_REVISION} was sent {served} request(s)"
    # the refusal is shown (the restarted proxy's registry) and logged once per proxy process,
    # not once per request
    shown = [k for k in await samples(proxy) if k.startswith(f"pd_pair_unpairable{{{d0},{other},")]
    assert len(shown) == 1, shown
    told = [
        line for line in corrupting.log_of(CHECKING_PROXY).splitlines()
        if "is never paired with decode" in line and OTHER_REVISION in line
    ]  # fmt: skip
    assert len(told) == 2, told


async def test_e2e_canaries_quarantine_the_corrupting_pair_without_traffic(
    corrupting: Deployment,
) -> None:
    """A proxy that no client uses, with canaries every 2 s: its canary through prefill-0 (no
    verify_kv) and decode-0 finds the first tokens differ and quarantines that pair; prefill-1's
    corruption is caught by verify_kv, so its canaries match."""
    p0, p1 = corrupting.url_of(UNCHECKED), corrupting.url_of(CHECKED)
    d0 = corrupting.url_of("decode-0")
    canaries = ("--canary-interval", "2")
    logs = LOG_DIR / "corrupt-canary"
    with own_proxy(corrupting, "proxy-canary", canaries, logs, like=CHECKING_PROXY) as url:
        deadline = time.monotonic() + 120
        while True:
            metrics = await samples(url)
            if metrics.get("pd_canaries_total{mismatch}") == 1.0:  # D recomputed
                break
            assert time.monotonic() < deadline, metrics
            await asyncio.sleep(1)
        assert metrics.get(f"pd_pair_quarantined{{{d0},{p0}}}") == 1.0
        assert metrics.get("pd_canaries_total{error}") == 0.0, metrics
        assert metrics.get(f"pd_pair_quarantined{{{d0},{p1}}}") is None
        assert not any(k.startswith("pd_requests_total{") for k in metrics)  # no client
