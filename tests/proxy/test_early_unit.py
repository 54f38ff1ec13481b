"""P's first token to the client before D's (``proxy.early``), through ``tests.proxy.mock``: a
streamed greedy decode-first request gets P's token as soon as P answers, then D's stream without
its first token, restamped as one answer; a D that goes on from another token is a break that
continues from P's; requests that must not take it do not."""

from __future__ import annotations

import asyncio
from typing import Any

import msgspec
import pytest

from pdwire.params import push_report
from proxy.config import Flow
from tests.proxy.inmemory import BINDING, D_URL, Exchange, InMemoryProxy, wait_until
from tests.proxy.mock import MockBackend, Reply

REPORT = push_report(None, None)
PROMPT_IDS = [1, 2, 3]


def p_answer(text: str = "Hello", token: int = 7, *, chat: bool = False) -> Reply:
    """P's whole answer as vLLM gives it with ``return_token_ids``."""
    choice: dict[str, Any] = {"index": 0, "token_ids": [token], "finish_reason": "length"}
    if chat:
        choice["message"] = {"role": "assistant", "content": text}
    else:
        choice["text"] = text
    obj = {
        "id": "chatcmpl-p" if chat else "cmpl-p",
        "object": "chat.completion" if chat else "text_completion",
        "created": 111,
        "model": "m",
        "choices": [choice],
        "kv_transfer_params": REPORT,
    }
    return Reply.json(obj)


def d_stream(pieces: list[tuple[str, int]], *, chat: bool = False, gate: Any = None) -> Reply:
    """D's stream with token ids (the proxy asks for them): one event per (text, id)."""
    head = {
        "id": "chatcmpl-d" if chat else "cmpl-d",
        "object": "chat.completion.chunk" if chat else "text_completion",
        "created": 222,
        "model": "m",
    }
    events: list[dict[str, Any]] = []
    if chat:
        role = {"index": 0, "delta": {"role": "assistant", "content": ""}}
        events.append({**head, "choices": [role], "prompt_token_ids": PROMPT_IDS})
    for i, (text, token) in enumerate(pieces):
        ch: dict[str, Any] = {"index": 0, "token_ids": [token], "finish_reason": None}
        if chat:
            ch["delta"] = {"content": text}
        else:
            ch["text"] = text
            if i == 0:
                ch["prompt_token_ids"] = PROMPT_IDS
        if i == len(pieces) - 1:
            ch["finish_reason"] = "length"
        events.append({**head, "choices": [ch]})
    body: list[Any] = [b"data: " + msgspec.json.encode(e) + b"\n\n" for e in events]
    body.append(b"data: [DONE]\n\n")
    reply = Reply(200, body, content_type=b"text/event-stream")
    return reply if gate is None else reply.after(gate)


def events(body: bytes) -> list[dict[str, Any]]:
    return [msgspec.json.decode(e[6:]) for e in body.split(b"\n\n") if e.startswith(b"data: {")]


def text_of(evs: list[dict[str, Any]], chat: bool = False) -> str:
    out = ""
    for e in evs:
        for c in e.get("choices", []):
            out += (c.get("delta", {}).get("content") or "") if chat else (c.get("text") or "")
    return out


def send(px: InMemoryProxy, *, chat: bool = False, **body: Any) -> Exchange:
    return px.request(stream=True, chat=chat, extra=body)


@pytest.mark.parametrize("chat", [False, True])
async def test_p_first_token_reaches_the_client_before_d_answers(chat: bool) -> None:
    gate = asyncio.Event()
    backend = MockBackend(
        {
            "prefill": p_answer(chat=chat),
            "decode": d_stream([("Hello", 7), (" world", 8), ("!", 9)], chat=chat, gate=gate),
            "get": Reply.json(BINDING),
        }
    )
    px = InMemoryProxy(backend, Flow.DECODE_FIRST)
    ex = send(px, chat=chat, temperature=0)
    await ex.parts(1)  # P's token is out while D has not answered
    assert ex.status == 200
    early = events(ex.body)
    assert text_of(early, chat) == "Hello"
    if chat:
        assert early[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    gate.set()
    await ex.done()
    got = events(ex.body)
    assert text_of(got, chat) == "Hello world!"  # D's "Hello" is not sent again
    assert {e["id"] for e in got} == {"chatcmpl-p" if chat else "cmpl-p"}
    assert {e["created"] for e in got} == {111}
    assert all(c.get("token_ids") is None for e in got for c in e["choices"])  # not asked
    assert all(e.get("prompt_token_ids") is None for e in got)
    roles = [e for e in got if e["choices"][0].get("delta", {}).get("role")]
    assert len(roles) == (1 if chat else 0)
    assert got[-1]["choices"][0]["finish_reason"] == "length"
    assert ex.body.endswith(b"data: [DONE]\n\n")
    assert px.requests("ok", 200) == 1
    assert counts(px) == {"sent": 1.0}
    await px.settle()


async def test_a_one_token_answer_keeps_d_finish_reason() -> None:
    gate = asyncio.Event()
    backend = MockBackend(
        {
            "prefill": p_answer(),
            "decode": d_stream([("Hello", 7)], gate=gate),
            "get": Reply.json(BINDING),
        }
    )
    px = InMemoryProxy(backend, Flow.DECODE_FIRST)
    ex = send(px, temperature=0, max_tokens=1)
    await ex.parts(1)
    gate.set()
    await ex.done()
    got = events(ex.body)
    assert text_of(got) == "Hello"
    assert [c["finish_reason"] for e in got for c in e["choices"]] == [None, "length"]
    await px.settle()


@pytest.mark.parametrize(
    "body",
    [
        {"temperature": 0.7},  # sampled: D's first token may rightly differ
        {},  # the engine's default temperature is not known to be 0
        {"temperature": 0, "logprobs": 2},
        {"temperature": 0, "return_token_ids": True},
        {"temperature": 0, "stop": ["x"]},  # not continuable elsewhere (``refusal``)
    ],
)
async def test_requests_that_must_not_take_p_first_token_get_d_own(body: dict[str, Any]) -> None:
    gate = asyncio.Event()
    backend = MockBackend(
        {
            "prefill": p_answer(),
            "decode": d_stream([("Hello", 7), (" world", 8)], gate=gate),
            "get": Reply.json(BINDING),
        }
    )
    px = InMemoryProxy(backend, Flow.DECODE_FIRST)
    ex = send(px, **body)
    await wait_until(lambda: len(backend.calls_of("prefill")) == 1)
    for _ in range(20):
        await asyncio.sleep(0)
    assert ex.status is None  # nothing before D answers
    gate.set()
    await ex.done()
    assert text_of(events(ex.body)) == "Hello world"
    assert counts(px) == {}
    await px.settle()


async def test_off_with_no_early_first_token() -> None:
    gate = asyncio.Event()
    backend = MockBackend(
        {
            "prefill": p_answer(),
            "decode": d_stream([("Hello", 7), (" world", 8)], gate=gate),
            "get": Reply.json(BINDING),
        }
    )
    px = InMemoryProxy(backend, Flow.DECODE_FIRST, early_first_token=False)
    ex = send(px, temperature=0)
    await wait_until(lambda: len(backend.calls_of("prefill")) == 1)
    for _ in range(20):
        await asyncio.sleep(0)
    assert ex.status is None
    gate.set()
    await ex.done()
    assert text_of(events(ex.body)) == "Hello world"
    await px.settle()


async def test_d_going_on_from_another_token_continues_from_p_token() -> None:
    """D's stream does not start with P's token (the first-token check off, so the walk does
    not catch it first): a break after P's token, continued from the prompt and P's token."""
    gate = asyncio.Event()
    backend = MockBackend(
        {
            "prefill": p_answer(),
            "decode": [
                d_stream([("Bye", 5), (" now", 6)], gate=gate),
                d_stream([(" world", 8), ("!", 9)]),  # the continuation
            ],
            "get": Reply.json(BINDING),
        }
    )
    px = InMemoryProxy(
        backend, Flow.DECODE_FIRST, first_token_check=False, decode=[D_URL, "http://d1:8201"]
    )
    ex = send(px, temperature=0, max_tokens=3)
    await ex.parts(1)
    gate.set()
    await ex.done()
    assert text_of(events(ex.body)) == "Hello world!"
    cont = msgspec.json.decode(backend.calls_of("decode")[1].body)
    assert cont["prompt"] == [*PROMPT_IDS, 7] and cont["max_tokens"] == 2
    assert counts(px) == {"sent": 1.0, "diverged": 1.0}
    await px.settle()


def counts(px: InMemoryProxy) -> dict[str, float]:
    return {
        s.labels["outcome"]: s.value
        for fam in px.runtime.metrics.early_first_tokens.collect()
        for s in fam.samples
        if s.name.endswith("_total")
    }


async def test_a_mismatch_the_check_catches_goes_on_from_d_computing_alone() -> None:
    """The first-token check on (the default): D's first token is not P's, the pair is
    quarantined and D computes the prompt itself; its answer starts with P's token, which the
    client already has."""
    gate = asyncio.Event()
    backend = MockBackend(
        {
            "prefill": p_answer(),
            "decode": [
                d_stream([("Bye", 5), (" now", 6)], gate=gate),
                d_stream([("Hello", 7), (" world", 8)]),  # D alone, from the prompt
            ],
            "get": Reply.json(BINDING),
        }
    )
    px = InMemoryProxy(backend, Flow.DECODE_FIRST)
    ex = send(px, temperature=0)
    await ex.parts(1)
    gate.set()
    await ex.done()
    assert text_of(events(ex.body)) == "Hello world"
    assert "kv_transfer_params" not in msgspec.json.decode(backend.calls_of("decode")[1].body)
    assert counts(px) == {"sent": 1.0}
    await px.settle()


async def test_a_failure_after_p_token_ends_the_stream_with_an_error_event() -> None:
    gate = asyncio.Event()
    backend = MockBackend(
        {
            "prefill": p_answer(),
            "decode": Reply.fail("D went away").after(gate),
            "get": Reply.json(BINDING),
        }
    )
    px = InMemoryProxy(backend, Flow.DECODE_FIRST)
    ex = send(px, temperature=0)
    await ex.parts(1)
    gate.set()
    await ex.done()
    assert ex.status == 200 and ex.ended
    assert text_of(events(ex.body)) == "Hello"
    assert b'"error"' in ex.body.split(b"\n\n")[-3]
    await px.settle()
