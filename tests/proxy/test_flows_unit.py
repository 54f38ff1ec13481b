"""prefill-first and direct through ``tests.proxy.mock``, and what reaches the client when D's
stream breaks: in memory, in milliseconds (``test_flows.py`` runs the same flows over real HTTP)."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from proxy.config import Flow
from proxy.errors import UpstreamError
from proxy.flows.prefill_first import PREFILL_PARAMS
from tests.proxy.inmemory import D_URL, P_URL, InMemoryProxy, sse_text
from tests.proxy.mock import MockBackend, Outcome, Reply

# what a pull connector's P answers; D must get it byte for byte
PULL_KV: dict[str, Any] = {
    "do_remote_prefill": True,
    "remote_engine_id": "e-1",
    "remote_block_ids": [3, 1, 2],
    "remote_host": "10.0.0.7",
}
P_USAGE = {"prompt_tokens": 40, "prompt_tokens_details": {"cached_tokens": 8}}
SSE = Reply.sse(["Hello", " world"])


def legs(backend: MockBackend) -> list[tuple[str, Outcome]]:
    return [(c.leg, c.outcome) for c in backend.calls]


async def test_prefill_first_nonstream_relays_kv_params_unchanged() -> None:
    backend = MockBackend(
        {
            "prefill": Reply.completion("x", kv_transfer_params=PULL_KV, usage=P_USAGE),
            "decode": Reply.completion("hi", usage={"prompt_tokens": 40, "completion_tokens": 4}),
        }
    )
    px = InMemoryProxy(backend, flow=Flow.PREFILL_FIRST)
    ex = await px.send()
    assert ex.status == 200 and ex.json()["choices"][0]["text"] == "hi"
    assert ex.json()["usage"]["prompt_tokens_details"] == {"cached_tokens": 8}
    assert legs(backend) == [("prefill", Outcome.RELEASED), ("decode", Outcome.RELEASED)]
    p, d = backend.calls
    assert (p.url, d.url) == (P_URL, D_URL) and p.request_id == d.request_id
    assert p.json()["kv_transfer_params"] == PREFILL_PARAMS
    assert p.json()["max_tokens"] == 1 and p.json()["stream"] is False
    assert d.json()["kv_transfer_params"] == PULL_KV and d.json()["max_tokens"] == 4
    assert b'"remote_block_ids":[3,1,2]' in d.body  # passed on as P wrote it
    await px.settle()
    assert px.abandoned == [] and px.requests("ok", 200) == 1


async def test_prefill_first_stream_relays_decode_chunks() -> None:
    backend = MockBackend({"prefill": Reply.completion(kv_transfer_params=PULL_KV), "decode": SSE})
    px = InMemoryProxy(backend, flow=Flow.PREFILL_FIRST)
    ex = await px.send(stream=True)
    assert ex.status == 200 and ex.headers[b"content-type"] == b"text/event-stream"
    assert ex.ended and sse_text(ex.body) == "Hello world"
    assert len(ex.chunks) == 4  # three events as D sent them, then the end of the body
    (d,) = backend.calls_of("decode")
    assert d.json()["stream"] is True and d.json()["kv_transfer_params"] == PULL_KV
    await px.settle()


async def test_prefill_first_without_kv_params_is_502_and_skips_decode(
    caplog: pytest.LogCaptureFixture,
) -> None:
    backend = MockBackend({"prefill": Reply.completion("x"), "decode": SSE})
    px = InMemoryProxy(backend, flow=Flow.PREFILL_FIRST)
    ex = await px.send()
    assert ex.status == 502 and ex.json()["error"]["message"] == "the prefill leg failed"
    assert "prefill answered without kv_transfer_params" in caplog.text  # the operator's
    assert legs(backend) == [("prefill", Outcome.RELEASED)]
    await px.settle()
    assert px.p.circuit.consecutive == 1


async def test_prefill_first_prefill_rejection_passes_through() -> None:
    rejected = Reply(400, [b'{"error":{"message":"max_tokens too large"}}'])
    backend = MockBackend({"prefill": rejected, "decode": SSE})
    px = InMemoryProxy(backend, flow=Flow.PREFILL_FIRST, retries=2)
    ex = await px.send()
    assert ex.status == 400  # the engine's words, in an error rebuilt from their fields
    assert ex.json() == {
        "error": {
            "message": "max_tokens too large",
            "type": "invalid_request_error",
            "param": None,
            "code": 400,
        }
    }
    assert legs(backend) == [("prefill", Outcome.FAILED)]  # a 4xx is never retried
    await px.settle()
    assert px.p.circuit.consecutive == 0  # the request's fault, not P's


async def test_direct_sends_decode_the_plain_request() -> None:
    backend = MockBackend({"decode": SSE})
    px = InMemoryProxy(backend, flow=Flow.DIRECT)
    ex = await px.send(stream=True)
    assert ex.status == 200 and sse_text(ex.body) == "Hello world"
    ((d, outcome),) = [(c, c.outcome) for c in backend.calls]
    assert outcome == Outcome.RELEASED and "kv_transfer_params" not in d.json()
    await px.settle()


async def test_stream_break_ends_with_error_event_and_aborts_binding() -> None:
    backend = MockBackend(
        {
            "decode": Reply.sse(["Hello", UpstreamError("connection reset"), " world"]),
            "get": Reply.json({"transfer_id": "t"}),
            "prefill": Reply.completion(kv_transfer_params={"push": "started"}),
        }
    )
    px = InMemoryProxy(backend)
    ex = await px.send(stream=True)
    assert ex.status == 200 and ex.ended and sse_text(ex.body) == "Hello"
    assert b"decode stream broke: connection reset" in ex.chunks[-1]
    assert ex.body.endswith(b"data: [DONE]\n\n")
    (d,) = backend.calls_of("decode")
    assert d.outcome == Outcome.CLOSED
    await px.settle()
    assert [(e.transfer_id, e.outcome, e.message) for e in px.abandoned] == [
        (d.transfer_id, "aborted", "stream_error")
    ]
    assert px.requests("stream_error", 200) == 1


async def test_stream_ending_without_done_is_an_error() -> None:
    backend = MockBackend({"decode": Reply.sse(["Hello"], done=False)})
    px = InMemoryProxy(backend, flow=Flow.DIRECT)
    ex = await px.send(stream=True)
    assert ex.status == 200 and b"decode stream ended early" in ex.chunks[-1]
    assert backend.calls[0].outcome == Outcome.CLOSED
    await px.settle()


async def test_idle_timeout_mid_stream_is_an_error() -> None:
    backend = MockBackend(
        {"decode": Reply.sse(["Hello", asyncio.Event(), " world"])}, idle_timeout_s=0.01
    )
    px = InMemoryProxy(backend, flow=Flow.DIRECT)
    ex = await px.send(stream=True)
    assert ex.status == 200 and b"no data in 0.01s" in ex.chunks[-1]
    assert backend.calls[0].outcome == Outcome.CLOSED
    await px.settle()
