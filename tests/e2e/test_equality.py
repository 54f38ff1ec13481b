"""Greedy output through P/D is token-for-token identical to a monolithic engine."""

from __future__ import annotations

import asyncio
import random
from typing import Any

import pytest

from tests.e2e.client import Generation, chat, client, complete
from tests.e2e.conftest import Engines
from tests.e2e.observe import newest_binding
from tests.e2e.stack import BLOCK_SIZE, CHUNK_TOKENS

pytestmark = pytest.mark.e2e


def prompt_ids(n: int, seed: int) -> list[int]:
    """A prompt of exactly ``n`` token ids (ids 3.. avoid the special tokens)."""
    rng = random.Random(seed)
    return [rng.randrange(3, 1000) for _ in range(n)]


async def latest_binding(engines: Engines) -> dict[str, Any]:
    """The deployment's newest binding, settled (``observe.newest_binding``)."""
    return await newest_binding(engines.pd.metaserver)


def assert_same(pd: Generation, ref: Generation) -> None:
    assert pd.token_ids == ref.token_ids
    assert pd.text == ref.text
    assert len(pd.logprobs) == len(ref.logprobs)
    for a, b in zip(pd.logprobs, ref.logprobs, strict=True):
        assert a == pytest.approx(b, abs=1e-4)


# (name, prompt length in tokens)
CASES = [
    ("shorter-than-a-block", BLOCK_SIZE - 5),
    ("partial-tail-block", 3 * BLOCK_SIZE + 7),
    ("three-chunks", 3 * CHUNK_TOKENS + 11),
]


@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
@pytest.mark.parametrize(("name", "length"), CASES, ids=[c[0] for c in CASES])
async def test_e2e_completion_equals_monolithic(
    engines: Engines, name: str, length: int, stream: bool
) -> None:
    prompt = prompt_ids(length, seed=length)
    ref = await complete(client(engines.mono_url), engines.model, prompt, stream=stream)
    got = await complete(client(engines.pd.proxy), engines.model, prompt, stream=stream)
    assert len(ref.token_ids) == 16
    assert_same(got, ref)


async def test_e2e_outputs_depend_on_the_prompt(engines: Engines) -> None:
    """Guards the equality tests: if every prompt gave the same answer they would prove nothing."""
    c = client(engines.mono_url)
    a = await complete(c, engines.model, prompt_ids(40, seed=1))
    b = await complete(c, engines.model, prompt_ids(40, seed=2))
    changed_start = prompt_ids(40, seed=1)
    changed_start[:2] = [5, 6]
    d = await complete(c, engines.model, changed_start)
    assert a.token_ids != b.token_ids
    assert a.token_ids != d.token_ids


@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
async def test_e2e_chat_equals_monolithic(engines: Engines, stream: bool) -> None:
    text = "Prefill and decode run on different machines; the KV cache travels between them. " * 3
    ref = await chat(client(engines.mono_url), engines.model, text, stream=stream)
    got = await chat(client(engines.pd.proxy), engines.model, text, stream=stream)
    assert_same(got, ref)


async def test_e2e_prefix_cache_hit_on_decode_is_skipped_and_still_equal(engines: Engines) -> None:
    base = prompt_ids(4 * BLOCK_SIZE + 3, seed=77)
    pd = client(engines.pd.proxy)
    await complete(pd, engines.model, base, max_tokens=2)  # D now holds base's full blocks
    first = await latest_binding(engines)
    longer = base + prompt_ids(2 * BLOCK_SIZE + 5, seed=78)
    ref = await complete(client(engines.mono_url), engines.model, longer)
    got = await complete(pd, engines.model, longer)
    assert_same(got, ref)
    second = await latest_binding(engines)
    assert second["decode_instance_id"] == first["decode_instance_id"]  # the prefix policy
    assert second["num_prompt_tokens"] == len(longer)
    assert second["num_cached_tokens"] >= 4 * BLOCK_SIZE  # P skipped the blocks D had
    assert second["state"] == "done"


async def test_e2e_concurrent_mixed_lengths_equal_monolithic(engines: Engines) -> None:
    # Was xfail (a rare divergence under concurrency, last seen before D held the blocks of a
    # transfer with a failed write for its settle time). Since: passed in 7 of 7 CI runs and in
    # 12 local rounds of 32 (384 requests), logprobs within 8e-6 of the monolithic engine's,
    # which is the monolithic engine's own batch-to-batch variation (6.7e-6).
    lengths = [random.Random(i).randrange(5, 400) for i in range(32)]
    prompts = [prompt_ids(n, seed=1000 + i) for i, n in enumerate(lengths)]
    mono, pd = client(engines.mono_url), client(engines.pd.proxy)
    refs = await asyncio.gather(*(complete(mono, engines.model, p, max_tokens=8) for p in prompts))
    gots = await asyncio.gather(
        *(
            complete(pd, engines.model, p, max_tokens=8, stream=i % 2 == 0)
            for i, p in enumerate(prompts)
        )
    )
    for got, ref in zip(gots, refs, strict=True):
        assert_same(got, ref)
