"""Negative control of the equality tests: with P's push deliberately corrupted (the test-only
``test_corrupt_push`` hook: garbage for the first block of layer 0), greedy output through P/D
differs from the monolithic engine — the equality check can see a wrong transfer. With
``verify_kv`` on as well, D's checksum check catches the corruption, fails the load, recomputes
(``kv_load_failure_policy=recompute``) and the answer is right again."""

from __future__ import annotations

import asyncio
import shutil
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.e2e.client import client, complete
from tests.e2e.conftest import LOG_DIR, Monolithic
from tests.e2e.observe import newest_binding
from tests.e2e.stack import BLOCK_SIZE, Deployment, base_options, deployment, running
from tests.e2e.test_equality import assert_same, prompt_ids

pytestmark = pytest.mark.e2e
PROMPT_TOKENS = 5 * BLOCK_SIZE + 9  # six blocks, four prefill chunks
HOOK_ON = "TEST HOOK test_corrupt_push IS ON"
MISMATCH = "does not match what P pushed"


@pytest.fixture(scope="module")
def corrupted(request: pytest.FixtureRequest, tiny_model: Path) -> Iterator[Deployment]:
    """A 1P1D deployment whose P corrupts every push; ``request.param``: verify_kv on both."""
    verify = bool(request.param)
    logs = LOG_DIR / ("corrupt-verify" if verify else "corrupt")
    shutil.rmtree(logs, ignore_errors=True)
    opts = base_options(
        tiny_model,
        # landing_wait_s: a mismatch that persists 1 s is corruption, not bytes still landing
        extra_connector_config={
            "test_corrupt_push": True,
            "verify_kv": verify,
            "landing_wait_s": 1,
        },
        extra_engine_env={"PDGATE_ALLOW_TEST_HOOKS": "1"},
    )
    dep = deployment(opts, logs)
    with running(dep, "the corrupting deployment") as d:
        yield d


async def wait_for_log(dep: Deployment, name: str, text: str, timeout_s: float = 10.0) -> str:
    deadline = time.monotonic() + timeout_s
    while True:
        log = dep.log_of(name)
        if text in log or time.monotonic() > deadline:
            return log
        await asyncio.sleep(0.2)


async def latest_binding(dep: Deployment) -> dict[str, Any]:
    return await newest_binding(dep.metaserver)


@pytest.mark.parametrize("corrupted", [False], indirect=True, ids=["verify-off"])
async def test_e2e_corrupted_push_breaks_equality(
    corrupted: Deployment, monolithic: Monolithic
) -> None:
    prompt = prompt_ids(PROMPT_TOKENS, seed=4242)
    ref = await complete(client(monolithic.ready()), monolithic.model, prompt)
    got = await complete(client(corrupted.proxy), monolithic.model, prompt)
    assert len(ref.token_ids) == 16 and len(got.token_ids) == 16
    assert got.token_ids != ref.token_ids, "corrupted KV went unnoticed by the equality check"
    binding = await latest_binding(corrupted)
    assert binding["state"] == "done"  # the push itself succeeded: D decoded from wrong KV
    assert binding["num_prompt_tokens"] == PROMPT_TOKENS
    assert HOOK_ON in corrupted.log_of("prefill-0")
    assert MISMATCH not in corrupted.log_of("decode-0")  # without verify_kv nobody notices


@pytest.mark.parametrize("corrupted", [True], indirect=True, ids=["verify-on"])
async def test_e2e_verify_kv_catches_corrupted_push(
    corrupted: Deployment, monolithic: Monolithic
) -> None:
    prompt = prompt_ids(PROMPT_TOKENS, seed=4343)
    ref = await complete(client(monolithic.ready()), monolithic.model, prompt)
    got = await complete(client(corrupted.proxy), monolithic.model, prompt)
    assert_same(got, ref)  # D recomputed instead of decoding from the corrupted KV
    binding = await latest_binding(corrupted)
    assert binding["state"] == "done" and binding["num_prompt_tokens"] == PROMPT_TOKENS
    assert HOOK_ON in corrupted.log_of("prefill-0")
    d_log = await wait_for_log(corrupted, "decode-0", MISMATCH)
    mismatches = [line for line in d_log.splitlines() if MISMATCH in line]
    assert len(mismatches) == 1, mismatches  # one transfer, caught once
    assert str(binding["transfer_id"]) in mismatches[0]
    assert "layer model.layers.0." in mismatches[0]  # names where the bad block landed
