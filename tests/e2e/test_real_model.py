"""A real model through P/D: SmolLM2-135M-Instruct (the demo's model, built from the package
index by ``launch/smollm2.py``) gives the same greedy tokens through a 1P1D deployment as a
monolithic engine, in English, with its prompt's KV pushed by P rather than recomputed by D.

The tiny random model of the other end-to-end tests was made for this suite; this one was
trained by someone else (30 layers, 9 heads / 3 KV heads, its own tokenizer and chat template).
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path

import pytest

from launch.smollm2 import make_smollm2
from tests.e2e.client import Generation, chat, client, complete
from tests.e2e.conftest import REPO
from tests.e2e.observe import newest_binding
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
from tests.e2e.test_equality import assert_same

pytestmark = pytest.mark.e2e

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
    model = make_smollm2(REPO / ".cache" / "models", log=lambda m: print(f"[smollm2] {m}"))
    mono = monolithic_child(model)
    mono_sup = start([mono], e2e_logs / "smollm2-mono")  # loads beside the P/D engines
    try:
        pd = deployment(base_options(model), e2e_logs / "smollm2-pd")
        with running(pd, "the SmolLM2 1P1D deployment") as dep:
            mono_sup.wait_ready(900)
            yield RealStack(model, dep, mono.health_url.removesuffix("/health"))
    finally:
        mono_sup.stop()


def english(g: Generation) -> bool:
    words = re.findall(r"[A-Za-z]{2,}", g.text)
    return len(words) >= 8 and len(" ".join(words)) >= 0.7 * len(g.text.strip())


async def test_e2e_real_model_chat_equals_monolithic_in_english(smollm2: RealStack) -> None:
    ref = await chat(client(smollm2.mono_url), smollm2.model, QUESTION, max_tokens=32)
    got = await chat(client(smollm2.pd.proxy), smollm2.model, QUESTION, max_tokens=32)
    assert_same(got, ref)
    assert english(got), got.text
    binding = await newest_binding(smollm2.pd.metaserver)
    assert binding["state"] == "done"


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
