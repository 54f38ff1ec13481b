"""A real model through P/D: SmolLM2-135M-Instruct (the demo's model, built from the package
index by ``launch/smollm2.py``) gives the same greedy tokens through a 1P1D deployment as a
monolithic engine, in English, with its prompt's KV pushed by P rather than recomputed by D.
The tiny random model of the other end-to-end tests was made for this suite; this one was
trained by someone else (30 layers, 9 heads / 3 KV heads, its own tokenizer and chat template).

Last, on the same deployment, its only prefill instance is killed while it pushes: the client
still gets the monolithic engine's answer. The proxy sees P's connection break before D's first
byte, reads that P had taken the binding, drops D's first request and sends D the plain one: D
computes the prompt itself (a retry would find no live P). D is left with nothing running or
held, and the binding is closed. (With a second P the same happens: tests/e2e/test_chaos.py.)
"""

from __future__ import annotations

import asyncio
import json
import re
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from launch.smollm2 import make_smollm2
from proxy.kvroute.tokens import HFTokenizer, token_ids_of
from tests.e2e.client import Generation, chat, client, complete
from tests.e2e.conftest import SMOLLM2_CACHE, wait_smollm2_build
from tests.e2e.engine_metrics import samples, wait_idle
from tests.e2e.observe import newest_binding, observer
from tests.e2e.stack import (
    BLOCK_SIZE,
    CHUNK_TOKENS,
    Deployment,
    base_options,
    deployment,
    monolithic_child,
    running,
    start,
)
from tests.e2e.test_equality import assert_same, prompt_ids

pytestmark = pytest.mark.e2e
# D's load deadline: how long a killed P's blocks stay held at most (the last test waits it out)
KV_LOAD_TIMEOUT_S = 30.0

QUESTION = "Explain prefill and decode in one sentence."
# a completion prompt of several prefill chunks (56 tokens each) and a partial last block
PASSAGE = (
    "Large language models answer in two phases. The first reads the whole prompt at once and "
    "fills a cache of keys and values for every layer; it is limited by arithmetic. The second "
    "produces one token at a time and reads that cache at every step; it is limited by memory "
    "bandwidth. Running the phases on separate machines lets each be sized for its own limit, "
    "at the cost of moving the cache between them. "
) * 3 + "In short, the two phases are called"


class RealStack:
    def __init__(self, model: Path, pd: Deployment, mono_url: str) -> None:
        self.model = model.name
        self.path = model
        self.pd = pd
        self.mono_url = mono_url


@pytest.fixture(scope="module")
def smollm2(e2e_logs: Path) -> Iterator[RealStack]:
    wait_smollm2_build()  # started in the background at collection (conftest)
    model = make_smollm2(SMOLLM2_CACHE, log=lambda m: print(f"[smollm2] {m}"))
    mono = monolithic_child(model)
    mono_sup = start([mono], e2e_logs / "smollm2-mono")  # loads beside the P/D engines
    try:
        pd = deployment(
            base_options(model, kv_load_timeout_s=KV_LOAD_TIMEOUT_S), e2e_logs / "smollm2-pd"
        )
        with running(pd, "the SmolLM2 1P1D deployment") as dep:
            mono_sup.wait_ready(900)
            yield RealStack(model, dep, mono.health_url.removesuffix("/health"))
    finally:
        mono_sup.stop()


def english(g: Generation) -> bool:
    words = re.findall(r"[A-Za-z]{2,}", g.text)
    return len(words) >= 8 and len(" ".join(words)) >= 0.7 * len(g.text.strip())


async def test_e2e_real_model_chat_equals_monolithic_in_english(smollm2: RealStack) -> None:
    # both engines' first forwards are slow: let them run side by side
    ref, got = await asyncio.gather(
        chat(client(smollm2.mono_url), smollm2.model, QUESTION, max_tokens=32),
        chat(client(smollm2.pd.proxy), smollm2.model, QUESTION, max_tokens=32),
    )
    assert_same(got, ref)
    assert english(got), got.text
    binding = await newest_binding(smollm2.pd.metaserver)
    assert binding["state"] == "done"


async def test_e2e_real_model_first_tokens_judged_as_text(smollm2: RealStack) -> None:
    """A greedy chat request without logprobs: D's answer carries no token ids, so the proxy
    compares P's and D's first tokens as text; on a real tokenizer that first token is judged,
    and it matches."""
    checks = "pd_first_token_checks_total{%s}"
    before = await samples(smollm2.pd.proxy)
    r = await client(smollm2.pd.proxy).chat.completions.create(
        model=smollm2.model,
        messages=[{"role": "user", "content": QUESTION}],
        max_tokens=8,
        temperature=0,
    )
    assert r.choices[0].message.content
    after = await samples(smollm2.pd.proxy)
    moved = {o: after[checks % o] - before[checks % o] for o in ("match", "mismatch", "unjudged")}
    assert moved == {"match": 1.0, "mismatch": 0.0, "unjudged": 0.0}, moved


async def streamed(url: str, model: str, chat: bool, prompt: str) -> tuple[str, set[str]]:
    """A greedy stream's text and its chunks' ids (no logprobs: they keep P's token back)."""
    c = client(url)
    text, ids = "", set[str]()
    if chat:
        stream = await c.chat.completions.create(
            model=model, messages=[{"role": "user", "content": prompt}], max_tokens=16,
            temperature=0, stream=True,
        )  # fmt: skip
        async for chunk in stream:
            ids.add(chunk.id)
            if chunk.choices:
                text += chunk.choices[0].delta.content or ""
    else:
        pieces = await c.completions.create(
            model=model, prompt=prompt, max_tokens=16, temperature=0, stream=True
        )
        async for piece in pieces:
            ids.add(piece.id)
            if piece.choices:
                text += piece.choices[0].text or ""
    return text, ids


@pytest.mark.parametrize("chat", [False, True], ids=["completion", "chat"])
async def test_e2e_real_model_first_token_from_p(smollm2: RealStack, chat: bool) -> None:
    """A streamed greedy request gets P's first token before D's (``proxy.early``): the text
    the client reads is the monolithic engine's, D's first token not repeated, one answer id."""
    sent = "pd_early_first_tokens_total{sent}"
    before = (await samples(smollm2.pd.proxy)).get(sent, 0.0)
    prompt = QUESTION if chat else PASSAGE
    ref, _ = await streamed(smollm2.mono_url, smollm2.model, chat, prompt)
    got, ids = await streamed(smollm2.pd.proxy, smollm2.model, chat, prompt)
    after = (await samples(smollm2.pd.proxy)).get(sent, 0.0)
    assert got == ref and english_text(got), got
    assert len(ids) == 1
    assert after == before + 1


def english_text(text: str) -> bool:
    return len(re.findall(r"[A-Za-z]{2,}", text)) >= 4


@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
async def test_e2e_real_model_long_prompt_is_pushed_and_equal(
    smollm2: RealStack, stream: bool
) -> None:
    ref = await complete(client(smollm2.mono_url), smollm2.model, PASSAGE, max_tokens=24)
    got = await complete(
        client(smollm2.pd.proxy), smollm2.model, PASSAGE, max_tokens=24, stream=stream
    )
    assert_same(got, ref)
    assert english(got), got.text
    binding = await newest_binding(smollm2.pd.metaserver)
    assert binding["state"] == "done"
    assert binding["num_prompt_tokens"] > 3 * CHUNK_TOKENS
    # every block of the prompt D did not hold already came from P's push
    (done,) = [e for e in binding["events"] if e["state"] == "done"]
    held = binding["num_cached_tokens"] // BLOCK_SIZE
    unheld = -(-binding["num_prompt_tokens"] // BLOCK_SIZE) - held
    assert done["detail"]["bytes_pushed"] == unheld * block_bytes(smollm2.path), binding


def block_bytes(model: Path) -> int:
    """Bytes of one KV block of every layer (float32 keys and values)."""
    c = json.loads((model / "config.json").read_text())
    head_dim = c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"]
    return c["num_hidden_layers"] * 2 * c["num_key_value_heads"] * head_dim * 4 * BLOCK_SIZE


CHATS = [
    [{"role": "user", "content": QUESTION}],
    [
        {"role": "system", "content": "You answer in one short sentence."},
        {"role": "user", "content": QUESTION},
        {"role": "assistant", "content": "One reads the prompt, the other writes the answer."},
        {"role": "user", "content": "And why run them apart?"},
    ],
]


async def test_e2e_real_model_prompt_tokens_as_the_engine_makes_them(smollm2: RealStack) -> None:
    """The kv policy's token ids (``proxy.kvroute.tokens`` on the model's own tokenizer and
    chat template) are the engine's own (vLLM's ``/tokenize``), for text and for chats."""
    tok = HFTokenizer(str(smollm2.path))
    cases: list[tuple[dict[str, Any], bool]] = [({"prompt": PASSAGE}, False)]
    cases += [({"messages": m}, True) for m in CHATS]
    async with httpx.AsyncClient(base_url=smollm2.mono_url, timeout=60) as http:
        for body, is_chat in cases:
            ours = token_ids_of(tok, body, is_chat)
            r = await http.post("/tokenize", json={"model": smollm2.model, **body})
            assert r.status_code == 200, r.text
            theirs = r.json()["tokens"]
            assert ours is not None and ours == theirs, (body, ours, theirs[:16])
            assert len(theirs) > 20


async def test_e2e_prefill_killed_mid_push(smollm2: RealStack) -> None:
    """Runs last: it kills the deployment's only P."""
    prompt = prompt_ids(1800, seed=99)  # ~33 chunks of 56 tokens: a long prefill to interrupt
    dep = smollm2.pd
    request = asyncio.create_task(complete(client(dep.proxy), smollm2.model, prompt, max_tokens=8))
    started = time.monotonic()
    async with observer(dep.metaserver, 10) as ms:
        while True:  # kill P once it has started pushing this transfer
            assert time.monotonic() - started < 120, "prefill never started"
            if request.done():
                pytest.fail(f"request ended before P was killed: {request.result()!r}")
            bindings = (await ms.get("/v1/bindings", params={"limit": 1})).json()["bindings"]
            if bindings and bindings[0]["state"] in ("prefill_started", "pushing"):
                break
            await asyncio.sleep(0.02)
        dep.supervisor._signal(dep.supervisor.procs["prefill-0"], signal.SIGKILL)
        killed_at = time.monotonic()
        got = await asyncio.wait_for(request, KV_LOAD_TIMEOUT_S + 60)
        answered_after = time.monotonic() - killed_at
        ref = await complete(client(smollm2.mono_url), smollm2.model, prompt, max_tokens=8)
        assert_same(got, ref)
        print(f"\nanswer {answered_after:.1f}s after P was killed")
        # D holds the aborted load's blocks until its load deadline at the latest
        await wait_idle(dep.url_of("decode-0"), KV_LOAD_TIMEOUT_S + 10, kv_level=0.0)
        final = (await ms.get(f"/v1/bindings/{bindings[0]['transfer_id']}")).json()
        # the proxy saw P's leg fail and marks it failed, or D's own abort of its dropped
        # first request landed first (D ends the binding of an aborted load)
        assert final["state"] in ("failed", "aborted"), final
        last = final["events"][-1]
        assert (last["state"], last["actor"]) in (("failed", "proxy"), ("aborted", "decode-0")), (
            last
        )
