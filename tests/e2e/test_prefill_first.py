"""prefill-first with a pull connector, on a deployment ``pd-launch`` starts as a user does.

vLLM's own NixlConnector on both engines (UCX, host memory), the proxy relaying P's
kv_transfer_params to D: greedy output equals the monolithic engine's, and D's prompt tokens
really come from P's KV (D computes none of them). The same run checks pd-launch itself, last:
it reported progress, printed a curl that works, and Ctrl-C stops every process it started (no
orphans). Besides ``tests/e2e/test_pd_launch.py`` (pdgate's own connector, compiled engines),
every other end-to-end deployment is built from pd-launch's own plan (``tests/e2e/stack.py``);
this one goes through its command line (``tests/e2e/launched.py``)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from tests.e2e.client import client, complete
from tests.e2e.conftest import LOG_DIR, Monolithic
from tests.e2e.engine_metrics import prompt_tokens_by_source
from tests.e2e.launched import Launched, check_curl_then_ctrl_c, delta, pd_launch, sources_after
from tests.e2e.stack import (
    BLOCK_SIZE,
    CHUNK_TOKENS,
    ENGINE_ARGS,
    MAX_MODEL_LEN,
    PROXY_ARGS,
    READY_TIMEOUT_S,
)
from tests.e2e.test_equality import assert_same, prompt_ids
from tests.support import rescues
from tests.support.procs import VENV_BIN, free_port_block

pytestmark = pytest.mark.e2e
MAX_TOKENS = 12
WARMUP_TIMEOUT_S = 45.0  # a 64-token warm-up answers in a few seconds when the pull works


@pytest.fixture(scope="module")
def nixl_pd(tiny_model: Path) -> Iterator[Launched]:
    """``pd-launch --connector nixl``: 1P1D, the proxy in the prefill-first flow, engine settings
    as the monolithic reference's. One block of ports: pd-launch counts engine and side-channel
    ports up from their bases, and two independent free ports can meet (a CI run: decode-0's
    HTTP port was taken)."""
    base = free_port_block(16)
    argv = [
        str(VENV_BIN / "pd-launch"), "--model", str(tiny_model), "--connector", "nixl",
        "--port", str(base), "--metaserver-port", str(base + 1),
        "--engine-base-port", str(base + 2), "--side-channel-base-port", str(base + 8),
        "--log-dir", str(LOG_DIR / "pd-launch"), "--ready-timeout", str(READY_TIMEOUT_S),
        "--max-model-len", str(MAX_MODEL_LEN), "--max-num-batched-tokens", str(CHUNK_TOKENS),
        "--block-size", str(BLOCK_SIZE), *(f"--engine-arg={a}" for a in ENGINE_ARGS),
        *(f"--proxy-arg={a}" for a in PROXY_ARGS),
    ]  # fmt: skip
    with pd_launch(argv, READY_TIMEOUT_S) as launched:
        yield launched


@pytest.fixture(scope="module")
async def nixl(nixl_pd: Launched, monolithic: Monolithic) -> Launched:
    """The deployment once D has pulled KV from P at least once. D's first pull starts with a
    NIXL handshake whose reply vLLM awaits only 5 s; on a loaded host it can time out, and D
    then recomputes that one request. Later requests reuse the handshake. The first pull can
    also hang: once in six CI runs the UCX transfer right after the handshake made no progress
    for 2.5 minutes (P's worker blocked, its EngineCore logging "No available shared memory
    broadcast block") and completed only once the request was aborted. So a warm-up request
    gets WARMUP_TIMEOUT_S, then the next one is tried; each extra warm-up is a rescue, listed
    at the end of the run."""
    d_url = nixl_pd.url_of("decode-0")
    for attempt in range(5):
        prompt = prompt_ids(2 * BLOCK_SIZE, seed=9100 + attempt)
        before = await prompt_tokens_by_source(d_url)
        warm = client(nixl_pd.proxy, timeout=WARMUP_TIMEOUT_S)
        try:
            got = await complete(warm, monolithic.model, prompt, max_tokens=1)
        except openai.APITimeoutError:
            rescues.record(f"NIXL warm-up {attempt}: no answer in {WARMUP_TIMEOUT_S}s")
            continue
        ref = await complete(client(monolithic.ready()), monolithic.model, prompt, max_tokens=1)
        assert_same(got, ref)  # a warm-up's answer is judged too
        after = await sources_after(d_url, before, len(prompt))
        if delta(after, before, "external_kv_transfer") > 0:
            return nixl_pd
        rescues.record(f"NIXL warm-up {attempt}: D computed the prompt (no pull)")
    pytest.fail("D never pulled KV from P: see the NIXL errors in decode-0.log")


@pytest.mark.parametrize(
    ("stream", "length"),
    [(False, 3 * BLOCK_SIZE + 7), (True, 4 * BLOCK_SIZE + 19)],
    ids=["json", "sse"],
)
async def test_e2e_prefill_first_nixl_equals_monolithic_with_pulled_kv(
    nixl: Launched, monolithic: Monolithic, stream: bool, length: int
) -> None:
    prompt = prompt_ids(length, seed=500 + length)  # fresh prompt: nothing cached on D
    p_url, d_url = nixl.url_of("prefill-0"), nixl.url_of("decode-0")
    ref = await complete(
        client(monolithic.ready()), monolithic.model, prompt, max_tokens=MAX_TOKENS, stream=stream
    )
    p_before, d_before = await prompt_tokens_by_source(p_url), await prompt_tokens_by_source(d_url)
    got = await complete(
        client(nixl.proxy), monolithic.model, prompt, max_tokens=MAX_TOKENS, stream=stream
    )
    p_after = await sources_after(p_url, p_before, length)
    d_after = await sources_after(d_url, d_before, length)
    assert len(ref.token_ids) == MAX_TOKENS
    assert_same(got, ref)
    assert delta(p_after, p_before, "local_compute") == length  # P computed the prompt …
    assert delta(d_after, d_before, "external_kv_transfer") == length  # … D pulled all of it
    assert delta(d_after, d_before, "local_compute") == 0  # and recomputed nothing


def test_e2e_pd_launch_printed_a_working_curl_and_ctrl_c_stops_everything(
    nixl_pd: Launched,
) -> None:
    """Last in this module: it stops the deployment."""
    assert "prefill-0 is ready" in nixl_pd.text() and "decode-0 is ready" in nixl_pd.text()
    check_curl_then_ctrl_c(nixl_pd, children=4)  # metaserver, prefill-0, decode-0, proxy
