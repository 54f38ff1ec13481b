"""What the proxy refuses or removes from a client's body before any engine sees it."""

from __future__ import annotations

import msgspec
import pytest

from pdwire.ascend import MAX_BATCH
from pdwire.errors import ParamsError
from pdwire.params import parse_decode_leg, parse_prefill_leg
from proxy.errors import BadRequest
from proxy.rewrite import ClientRequest


def test_kv_transfer_params_are_stripped_also_from_vllm_xargs() -> None:
    # before: vLLM copies vllm_xargs into the sampling params' extra_args, where the
    # connector reads kv_transfer_params, so a client could still hand an engine its own
    evil = {"do_remote_prefill": True, "transfer_id": "victim-1"}
    raw = msgspec.json.encode(
        {
            "model": "m",
            "prompt": "hi",
            "kv_transfer_params": evil,
            "vllm_xargs": {"kv_transfer_params": evil, "my_arg": 3},
        }
    )
    req = ClientRequest.parse(raw, chat=False)
    sent = msgspec.json.decode(req.for_decode(None))
    assert "kv_transfer_params" not in sent
    assert sent["vllm_xargs"] == {"my_arg": 3}  # the client's own extra args pass


def test_a_deeply_nested_body_is_a_400() -> None:
    # before: msgspec's RecursionError escaped as a 500 with a traceback per request
    raw = b'{"model": "m", "prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    with pytest.raises(BadRequest, match="nested too deeply"):
        ClientRequest.parse(raw, chat=False)


@pytest.mark.parametrize("value", ["boom", 3, ["do_remote_prefill"], True])
def test_kv_transfer_params_that_are_not_an_object_are_refused(value: object) -> None:
    # an engine behind no proxy gets whatever a client sends; the connector then computes
    # locally (ParamsError is caught per request) instead of crashing the engine core
    for parse in (parse_decode_leg, parse_prefill_leg):
        with pytest.raises(ParamsError, match="must be an object"):
            parse(value)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "prompt", [["a"] * (MAX_BATCH + 1), [[1, 2]] * (MAX_BATCH + 1)], ids=["texts", "token-lists"]
)
def test_more_prompts_than_a_batch_are_refused(prompt: list[object]) -> None:
    # before: every prompt became a binding and a proxy task (the ascend flow: a long-poll
    # each), so one 16 MiB body of short prompts held millions of them
    with pytest.raises(BadRequest, match=f"at most {MAX_BATCH} prompts"):
        ClientRequest.parse(msgspec.json.encode({"model": "m", "prompt": prompt}), chat=False)
    ok = ClientRequest.parse(
        msgspec.json.encode({"model": "m", "prompt": prompt[:MAX_BATCH]}), chat=False
    )
    assert ok.prompt is not None
    many_tokens = ClientRequest.parse(
        msgspec.json.encode({"model": "m", "prompt": list(range(5000))}), chat=False
    )
    assert many_tokens.tokens == 5000  # one prompt of token ids is not a batch


@pytest.mark.parametrize(
    ("extra", "error"),
    [
        ({"n": 17}, "'n' may be at most 16, not 17"),
        ({"best_of": 1000}, "'best_of' may be at most 16, not 1000"),
        ({"n": 0}, "'n' must be a positive integer"),
        ({"n": "4"}, "'n' must be a positive integer"),
        ({"n": True}, "'n' must be a positive integer"),
    ],
)
def test_more_choices_than_allowed_are_a_400(extra: dict[str, object], error: str) -> None:
    # before: n=100000 went to D as is, 100,000 sequences decoded for one request
    raw = msgspec.json.encode({"model": "m", "prompt": "hi", **extra})
    with pytest.raises(BadRequest, match=error):
        ClientRequest.parse(raw, chat=False)


def test_choices_up_to_the_cap_pass_and_the_cap_is_configurable() -> None:
    def body(n: int) -> bytes:
        return msgspec.json.encode({"model": "m", "prompt": "hi", "n": n})

    assert ClientRequest.parse(body(16), chat=False).body["n"] == 16
    assert ClientRequest.parse(body(17), chat=False, max_choices=32).body["n"] == 17
