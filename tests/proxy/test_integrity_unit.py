"""The first-token check (``proxy.integrity``) through ``tests.proxy.mock``: on a greedy request P's
first token and D's must agree; a mismatch quarantines the pair, D computes the prompt itself,
and the client gets only the recomputed answer."""

from __future__ import annotations

from typing import Any

import msgspec
import pytest

from pdwire.params import push_report
from proxy.config import Flow
from proxy.errors import UpstreamError
from proxy.integrity import First, PairGuard, StreamText, Verdict, judge, judged
from proxy.metrics import Metrics
from proxy.rewrite import epoch_salt
from tests.proxy.inmemory import (
    BINDING,
    D_URL,
    P_URL,
    SSE,
    InMemoryProxy,
    never,
    sse_text,
    wait_until,
)
from tests.proxy.mock import MockBackend, Outcome, Reply

GREEDY = {"temperature": 0}
REPORT = push_report(None, None)


def _p(text: str) -> Reply:
    return Reply.completion(text, kv_transfer_params=REPORT)


def _chat_sse(pieces: list[str]) -> Reply:
    """A chat stream as vLLM sends it: the role first, then one content delta per piece."""
    chunks = [{"index": 0, "delta": {"role": "assistant", "content": ""}}]
    chunks += [{"index": 0, "delta": {"content": p}} for p in pieces]
    chunks[-1]["finish_reason"] = "length"
    body: list[Any] = [
        b"data: " + msgspec.json.encode({"id": "c", "object": "chat.completion.chunk",
                                         "choices": [c]}) + b"\n\n"
        for c in chunks
    ]  # fmt: skip
    body.append(b"data: [DONE]\n\n")
    return Reply(200, body, content_type=b"text/event-stream")


def _chat_p(text: str) -> Reply:
    obj = {
        "id": "c",
        "object": "chat.completion",
        "choices": [{"index": 0, "message": {"role": "assistant", "content": text}}],
        "kv_transfer_params": REPORT,
    }
    return Reply.json(obj)


def _chat_text(body: bytes) -> str:
    out = ""
    for event in body.split(b"\n\n"):
        if event.startswith(b"data: {"):
            for c in msgspec.json.decode(event[6:])["choices"]:
                out += c.get("delta", {}).get("content") or ""
    return out


# -- the rules ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("body", "expected"),
    [
        ({"temperature": 0}, True),
        ({"temperature": 0.0, "top_p": 0.5}, True),
        ({}, False),  # the server's default temperature is not known to be 0
        ({"temperature": 0.7}, False),
        ({"temperature": False}, False),
        ({"temperature": 0, "min_tokens": 2}, False),  # P's leg drops min_tokens
        ({"temperature": 0, "min_completion_tokens": 1}, False),
        ({"temperature": 0, "echo": True}, False),
        ({"temperature": 0, "best_of": 2}, False),
        ({"temperature": 0, "best_of": 1}, True),
    ],
)
def test_judged_only_greedy_requests_sampled_alike(body: dict[str, Any], expected: bool) -> None:
    assert judged(body) is expected


@pytest.mark.parametrize(
    ("p", "d", "verdict"),
    [
        (First("Hello"), First("Hello world"), Verdict.MATCH),
        (First("Hello"), First("Hello"), Verdict.MATCH),
        (First("Hello"), First("Bye"), Verdict.MISMATCH),
        (First("Hello"), First("Help"), Verdict.MISMATCH),
        (First("Hello"), First("Hel"), Verdict.UNJUDGED),  # D ended before P's text did
        (First(""), First("Hello"), Verdict.UNJUDGED),  # EOS or a special token
        (First("\ufffd"), First("x"), Verdict.UNJUDGED),  # half a UTF-8 character
        (First("Hello"), First(None), Verdict.UNJUDGED),  # D sent no content
        # ids decide when both answers carry them, whatever the text shows
        (First("\ufffd", 7), First("", 7), Verdict.MATCH),
        (First("Hello", 7), First("Hello", 8), Verdict.MISMATCH),
        (First("Hello", 7), First("Bye", None), Verdict.MISMATCH),  # D's text alone
    ],
)
def test_judge(p: First, d: First, verdict: Verdict) -> None:
    assert judge(p, d) is verdict


def test_stream_text_reads_choice_zero_and_skips_a_cut_event() -> None:
    a = b'data: {"choices":[{"index":1,"text":"B"},{"index":0,"text":"He"}]}\n\n'
    b = b'data: {"choices":[{"index":0,"text":"llo","finish_reason":"length"}]}\n\n'
    seen = StreamText(a + b[:20], chat=False)
    assert (seen.text, seen.ended, seen.token_id) == ("He", False, None)
    seen = StreamText(a + b + b"data: [DONE]\n\n", chat=False)
    assert (seen.text, seen.ended) == ("Hello", True)


def test_stream_text_first_token_id() -> None:
    lp = b'"logprobs":{"tokens":["token_id:41"]}'
    completions = b'data: {"choices":[{"index":0,"text":"","' + lp[1:] + b"}]}\n\n"
    assert StreamText(completions, chat=False).first == First(None, 41)
    ids = b'data: {"choices":[{"index":0,"text":"x","token_ids":[9]}]}\n\n'
    assert StreamText(ids + completions, chat=False).first == First("x", 9)  # the first wins
    role = b'data: {"choices":[{"index":0,"delta":{"role":"assistant","content":""}}]}\n\n'
    chat = (
        b'data: {"choices":[{"index":0,"delta":{"content":"Hi"},'
        b'"logprobs":{"content":[{"token":"token_id:5","logprob":-0.1}]}}]}\n\n'
    )
    assert StreamText(role + chat, chat=True).first == First("Hi", 5)


async def test_quarantine_expires() -> None:
    now = [0.0]
    guard = PairGuard(60.0, Metrics(list), clock=lambda: now[0])
    px = InMemoryProxy(MockBackend({}))
    guard.record(Verdict.MISMATCH, px.p, px.d, "t", "P 'a', D 'b'")
    assert guard.blocked(px.p, px.d) and guard.quarantined() == [(P_URL, D_URL)]
    now[0] = 59.9
    assert guard.blocked(px.p, px.d)
    now[0] = 60.0
    assert not guard.blocked(px.p, px.d) and guard.quarantined() == []


# -- through the proxy -------------------------------------------------------------------------


@pytest.mark.parametrize("flow", [Flow.DECODE_FIRST, Flow.PREFILL_FIRST])
async def test_matching_first_tokens_pass_untouched(flow: Flow) -> None:
    p = (
        _p("Hello")
        if flow is Flow.DECODE_FIRST
        else Reply.completion("Hello", kv_transfer_params={})
    )
    backend = MockBackend({"decode": Reply.sse(["Hello", " world"]), "get": Reply.json(BINDING),
                           "prefill": p})  # fmt: skip
    px = InMemoryProxy(backend, flow=flow)
    ex = await px.request(stream=True, extra=GREEDY).done()
    assert ex.status == 200 and sse_text(ex.body) == "Hello world"
    assert px.metric("pd_first_token_checks_total", outcome="match") == 1
    assert [c.outcome for c in backend.calls_of("decode")] == [Outcome.RELEASED]
    await px.settle()


async def test_mismatch_stream_quarantines_and_d_recomputes() -> None:
    decode = [Reply.sse(["Hello", " world"]), Reply.sse(["Bye", " now"])]
    backend = MockBackend({"decode": decode, "get": Reply.json(BINDING), "prefill": _p("Bye")})
    px = InMemoryProxy(backend)
    ex = await px.request(stream=True, extra=GREEDY).done()
    assert ex.status == 200 and sse_text(ex.body) == "Bye now"  # never "Hello"
    first, second = backend.calls_of("decode")
    assert first.outcome is Outcome.CLOSED and "kv_transfer_params" in first.json()
    assert "cache_salt" not in first.json()
    # D's prefix cache now holds the wrong blocks: the recompute, and every later request to
    # D, comes in a new cache epoch, so none of them is reused
    assert "kv_transfer_params" not in second.json() and second.json()["cache_salt"] == "pdgate-1"
    assert px.metric("pd_first_token_checks_total", outcome="mismatch") == 1
    assert px.metric("pd_pair_mismatches_total", prefill=P_URL, decode=D_URL) == 1
    assert px.metric("pd_pair_quarantined", prefill=P_URL, decode=D_URL) == 1
    reason = "first_token_mismatch"
    assert px.metric("pd_decode_without_prefill_total", reason=reason) == 1
    await px.settle()
    corrupt = [m for m in px.marks if m.mark == "corrupt"]
    assert len(corrupt) == 1 and corrupt[0].transfer_id == first.transfer_id
    assert corrupt[0].detail is not None and "'Bye'" in (corrupt[0].detail.outcome or "")

    # the quarantined pair is not paired again: D computes the next prompt itself
    backend.route("decode", Reply.sse(["Bye", " again"]))
    ex = await px.request(stream=True, extra=GREEDY).done()
    assert ex.status == 200 and sse_text(ex.body) == "Bye again"
    assert len(backend.calls_of("prefill")) == 1
    assert backend.calls_of("decode")[-1].json()["cache_salt"] == "pdgate-1"
    assert px.metric("pd_decision_total", decision="no_compatible_prefill") == 1
    await px.settle()


async def test_mismatch_not_streamed() -> None:
    decode = [Reply.completion("Hello world"), Reply.completion("Bye now")]
    backend = MockBackend({"decode": decode, "get": Reply.json(BINDING), "prefill": _p("Bye")})
    px = InMemoryProxy(backend)
    ex = await px.request(extra=GREEDY).done()
    assert ex.status == 200 and ex.json()["choices"][0]["text"] == "Bye now"
    assert px.metric("pd_first_token_checks_total", outcome="mismatch") == 1
    await px.settle()


async def test_mismatch_prefill_first() -> None:
    decode = [Reply.sse(["Hello"]), Reply.sse(["Bye"])]
    p = Reply.completion("Bye", kv_transfer_params={"remote": "x"})
    backend = MockBackend({"decode": decode, "prefill": p})
    px = InMemoryProxy(backend, flow=Flow.PREFILL_FIRST)
    ex = await px.request(stream=True, extra=GREEDY).done()
    assert ex.status == 200 and sse_text(ex.body) == "Bye"
    first, second = backend.calls_of("decode")
    assert first.outcome is Outcome.CLOSED and "kv_transfer_params" not in second.json()
    await px.settle()


async def test_chat_stream_reads_past_the_role_chunk() -> None:
    decode = [_chat_sse(["Hel", "lo", " there"]), _chat_sse(["Bye"])]
    backend = MockBackend({"decode": decode, "get": Reply.json(BINDING),
                           "prefill": _chat_p("Hello")})  # fmt: skip
    px = InMemoryProxy(backend)
    ex = await px.request(stream=True, chat=True, extra=GREEDY).done()
    assert ex.status == 200 and _chat_text(ex.body) == "Hello there"
    assert px.metric("pd_first_token_checks_total", outcome="match") == 1
    assert len(backend.calls_of("decode")) == 1
    await px.settle()


async def test_not_greedy_or_off_is_not_judged() -> None:
    backend = MockBackend({"decode": Reply.sse(["Hello"]), "get": Reply.json(BINDING),
                           "prefill": _p("Bye")})  # fmt: skip
    px = InMemoryProxy(backend)
    ex = await px.request(stream=True, extra={"temperature": 0.8}).done()
    assert ex.status == 200 and sse_text(ex.body) == "Hello"
    for outcome in Verdict:
        assert px.metric("pd_first_token_checks_total", outcome=outcome.value) == 0
    await px.settle()

    px = InMemoryProxy(backend, first_token_check=False)
    ex = await px.request(stream=True, extra=GREEDY).done()
    assert ex.status == 200 and sse_text(ex.body) == "Hello"
    await px.settle()


async def test_partial_character_is_unjudged() -> None:
    backend = MockBackend({"decode": Reply.sse(["\u00e9t\u00e9"]), "get": Reply.json(BINDING),
                           "prefill": _p("\ufffd")})  # fmt: skip
    px = InMemoryProxy(backend)
    ex = await px.request(stream=True, extra=GREEDY).done()
    assert ex.status == 200 and sse_text(ex.body) == "\u00e9t\u00e9"
    assert px.metric("pd_first_token_checks_total", outcome="unjudged") == 1
    await px.settle()


# -- canaries ----------------------------------------------------------------------------------


async def test_canary_judges_an_unjudged_pair_once_per_interval() -> None:
    backend = MockBackend({"decode": Reply.completion("Hello"), "get": Reply.json(BINDING),
                           "prefill": _p("Hello")})  # fmt: skip
    px = InMemoryProxy(backend, canary_interval_s=60)
    canaries = px.runtime.canaries
    assert canaries is not None
    assert await canaries.round() == 1
    (d,) = backend.calls_of("decode")
    sent = d.json()
    assert sent["temperature"] == 0 and sent["max_tokens"] == 1 and "model" not in sent
    assert px.metric("pd_canaries_total", outcome="match") == 1
    assert await canaries.round() == 0  # judged just now
    await px.settle()


async def test_canary_mismatch_quarantines_without_client_traffic() -> None:
    decode = [Reply.completion("Hello"), Reply.completion("Bye")]
    backend = MockBackend({"decode": decode, "get": Reply.json(BINDING), "prefill": _p("Bye")})
    px = InMemoryProxy(backend, canary_interval_s=60)
    canaries = px.runtime.canaries
    assert canaries is not None
    assert await canaries.round() == 1
    assert px.metric("pd_canaries_total", outcome="mismatch") == 1
    assert px.metric("pd_pair_quarantined", prefill=P_URL, decode=D_URL) == 1
    assert await canaries.round() == 0  # a quarantined pair gets no canary
    await px.settle()


async def test_canary_failure_is_counted() -> None:
    backend = MockBackend({"decode": Reply.completion("Hello"), "get": Reply.json(BINDING),
                           "prefill": Reply.fail()})  # fmt: skip
    px = InMemoryProxy(backend, canary_interval_s=60)
    canaries = px.runtime.canaries
    assert canaries is not None
    assert await canaries.probe(px.p, px.d) == "error"
    assert px.metric("pd_canaries_total", outcome="error") == 1
    await px.settle()


async def test_no_canaries_by_default_or_without_the_check() -> None:
    backend = MockBackend({})
    assert InMemoryProxy(backend).runtime.canaries is None
    px = InMemoryProxy(backend, canary_interval_s=5, first_token_check=False)
    assert px.runtime.canaries is None
    assert InMemoryProxy(backend, flow=Flow.DIRECT, canary_interval_s=5).runtime.canaries is None


async def test_ids_decide_when_both_answers_carry_them() -> None:
    """P's leg asks for its token's id; D's answer shows its own through the client's
    ``logprobs`` with ``return_tokens_as_token_ids``: text that cannot tell does not matter."""
    p = Reply.json(
        {"choices": [{"index": 0, "text": "\ufffd", "token_ids": [7], "prompt_token_ids": [1, 2]}],
         "kv_transfer_params": REPORT}
    )  # fmt: skip

    def d_answer(token: int) -> Reply:
        lp = {"tokens": [f"token_id:{token}"], "token_logprobs": [-0.5]}
        return Reply.json(
            {"object": "text_completion", "choices": [{"index": 0, "text": "", "logprobs": lp}]}
        )

    backend = MockBackend({"decode": [d_answer(8), d_answer(7)], "get": Reply.json(BINDING),
                           "prefill": p})  # fmt: skip
    px = InMemoryProxy(backend)
    extra = {**GREEDY, "logprobs": 1, "return_tokens_as_token_ids": True}
    ex = await px.request(extra=extra).done()
    assert ex.status == 200
    assert ex.json()["choices"][0]["logprobs"]["tokens"] == ["token_id:7"]
    (p_call,) = backend.calls_of("prefill")
    assert p_call.json()["return_token_ids"] is True
    assert px.metric("pd_first_token_checks_total", outcome="mismatch") == 1
    await px.settle()

    px = InMemoryProxy(MockBackend({"decode": SSE, "get": Reply.json(BINDING), "prefill": p}))
    await px.request(stream=True).done()  # sampled: P's leg is left as it was
    (p_call,) = px.backend.calls_of("prefill")
    assert "return_token_ids" not in p_call.json()
    await px.settle()


def test_epoch_salt_keeps_client_salts_apart() -> None:
    a, b = epoch_salt("tenant-a", 2), epoch_salt("tenant-b", 2)
    assert a != b and a != epoch_salt("tenant-a", 3)
    assert a.startswith("pdgate-2-") and len(epoch_salt("x" * 500, 9)) <= 128
    assert epoch_salt(None, 1) == "pdgate-1" and "/" not in a and "@" not in a


async def test_client_leaving_while_d_first_content_is_awaited_closes_d() -> None:
    decode = Reply.sse(["", never(), "Hello"])  # D's first chunk carries no content yet
    backend = MockBackend({"decode": decode, "get": Reply.json(BINDING), "prefill": _p("Hello")})
    px = InMemoryProxy(backend)
    ex = px.request(stream=True, extra=GREEDY)
    await wait_until(lambda: any(c.waiting for c in backend.calls_of("decode")))
    ex.disconnect()
    await ex.done()
    assert [c.outcome for c in backend.calls_of("decode")] == [Outcome.CLOSED]
    await px.settle()


async def test_d_breaking_while_its_first_content_is_awaited_fails_the_attempt(
    caplog: pytest.LogCaptureFixture,
) -> None:
    decode = Reply.sse(["", UpstreamError("connection reset")])
    backend = MockBackend({"decode": decode, "get": Reply.json(BINDING), "prefill": _p("Hello")})
    px = InMemoryProxy(backend)
    ex = await px.request(stream=True, extra=GREEDY).done()
    assert ex.status == 502 and ex.json()["error"]["message"] == "the decode leg failed"
    assert "reading D's first content: connection reset" in caplog.text  # the operator's
    await px.settle()
