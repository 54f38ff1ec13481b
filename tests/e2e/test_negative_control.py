"""Negative control of the equality tests: with P's push deliberately corrupted (the test-only
``test_corrupt_push`` hook: garbage for the first block of layer 0), greedy output through P/D
differs from the monolithic engine — the equality check can see a wrong transfer. With
``verify_kv`` on as well, D's checksum check catches the corruption, fails the load, recomputes
(``kv_load_failure_policy=recompute``) and the answer is right again.

One deployment serves both: two corrupting prefill engines, ``verify_kv`` off on prefill-0 and
on on prefill-1 (the setting is P's: it decides what P's digests describe), one decode engine,
and a proxy taking the prefill engines in turn. Each test sends prompts until one went through
the P it is about, and judges every answer by the P that served it."""

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

from launch.plan import build_plan
from tests.e2e.client import Generation, client, complete
from tests.e2e.conftest import LOG_DIR, Monolithic
from tests.e2e.observe import newest_binding
from tests.e2e.stack import BLOCK_SIZE, PROXY_ARGS, Deployment, base_options, deploy, running
from tests.e2e.test_equality import assert_same, prompt_ids

pytestmark = pytest.mark.e2e
PROMPT_TOKENS = 5 * BLOCK_SIZE + 9  # six blocks, four prefill chunks
HOOK_ON = "TEST HOOK test_corrupt_push IS ON"
MISMATCH = "does not match what P pushed"
UNCHECKED, CHECKED = "prefill-0", "prefill-1"  # verify_kv off, on
TRIES = 4  # round robin over two: each P serves one of any two prompts in a row


@pytest.fixture(scope="module")
def corrupting(tiny_model: Path) -> Iterator[Deployment]:
    logs = LOG_DIR / "corrupt"
    shutil.rmtree(logs, ignore_errors=True)
    opts = base_options(
        tiny_model,
        prefill=2,
        # landing_wait_s: a mismatch that persists 1 s is corruption, not bytes still landing
        extra_connector_config={"test_corrupt_push": True, "landing_wait_s": 1},
        extra_engine_env={"PDGATE_ALLOW_TEST_HOOKS": "1"},
        extra_proxy_args=(*PROXY_ARGS, "--prefill-policy", "round_robin"),
    )
    plan = build_plan(opts)
    plan.children[:] = [
        replace(c, argv=with_verify_kv(c.argv)) if c.name == CHECKED else c for c in plan.children
    ]
    with running(deploy(plan, logs), "the corrupting deployment") as d:
        yield d


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


async def through(dep: Deployment, mono: Monolithic, seed: int) -> Served:
    prompt = prompt_ids(PROMPT_TOKENS, seed=seed)
    ref = await complete(client(mono.ready()), mono.model, prompt)
    got = await complete(client(dep.proxy), mono.model, prompt)
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
