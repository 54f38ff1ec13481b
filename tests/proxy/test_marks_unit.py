"""The proxy's binding marks (``first_token``, ``end``, with ``--binding-marks``) through
``tests.proxy.mock``: off by default, posted for decode-first requests only, with the proxy's own
timings, in the background — a metaserver that never answers them does not hold the client's
answer."""

from __future__ import annotations

import asyncio

from pdwire.models import BindingState, MarkDetail, MarkKind
from pdwire.params import push_report
from proxy.config import Flow
from tests.proxy.inmemory import BINDING, PUSHED, SSE, InMemoryProxy, never
from tests.proxy.mock import MockBackend, RecordedAbandon, Reply

FIRST, END = MarkKind.FIRST_TOKEN, MarkKind.END


def _since(detail: MarkDetail | None) -> float:
    assert detail is not None and detail.since_request_s is not None
    return detail.since_request_s


async def test_marks_stream_reports_first_token_then_end() -> None:
    decode = Reply.sse(["Hello", " world"])
    backend = MockBackend({"decode": decode, "get": Reply.json(BINDING), "prefill": PUSHED})
    px = InMemoryProxy(backend, binding_marks=True)
    ex = await px.send(stream=True)
    assert ex.status == 200 and ex.ended
    await px.settle()
    (d,) = backend.calls_of("decode")
    assert [(m.transfer_id, m.mark, m.actor) for m in px.marks] == [
        (d.transfer_id, FIRST, "proxy"),
        (d.transfer_id, END, "proxy"),
    ]
    first, end = px.marks
    assert first.detail is not None and first.detail.outcome is None
    assert end.detail is not None and end.detail.outcome == "ok"
    assert end.detail.chunks == 3  # one per event as D sent them: two tokens, then [DONE]
    assert 0 <= _since(first.detail) <= _since(end.detail) < 5
    assert px.abandoned == []


async def test_marks_nonstream_and_concurrent_flow() -> None:
    backend = MockBackend({"decode": Reply.completion("hi"), "prefill": PUSHED})
    px = InMemoryProxy(backend, flow=Flow.CONCURRENT, binding_marks=True)
    ex = await px.send()
    assert ex.status == 200
    await px.settle()
    (d,) = backend.calls_of("decode")
    assert [(m.transfer_id, m.mark) for m in px.marks] == [
        (d.transfer_id, FIRST),
        (d.transfer_id, END),
    ]
    assert px.marks[1].detail is not None and px.marks[1].detail.chunks is None  # not streamed


async def test_marks_none_without_a_binding() -> None:
    backend = MockBackend({"decode": Reply.completion("hi")})
    px = InMemoryProxy(backend, flow=Flow.DIRECT, binding_marks=True)
    ex = await px.send()
    assert ex.status == 200
    await px.settle()
    assert px.marks == [] and px.abandoned == []


async def test_marks_end_of_an_abandoned_stream_says_why() -> None:
    decode = Reply.sse(["Hello", never(), " world"])
    backend = MockBackend({"decode": decode, "get": Reply.json(BINDING), "prefill": PUSHED})
    px = InMemoryProxy(backend, binding_marks=True)
    ex = px.request(stream=True)
    await ex.parts(1)
    ex.disconnect()
    await ex.done()
    await px.settle()
    (d,) = backend.calls_of("decode")
    assert [(m.mark, m.detail.outcome if m.detail else None) for m in px.marks] == [
        (FIRST, None),
        (END, "client_disconnected"),
    ]
    assert px.abandoned == [
        RecordedAbandon(d.transfer_id, BindingState.ABORTED, "proxy", "client_disconnected")
    ]


async def test_marks_never_hold_the_answer() -> None:
    """A metaserver that never answers a mark: the client still gets its whole answer."""
    backend = MockBackend({"decode": SSE, "get": Reply.json(BINDING), "prefill": PUSHED})
    px = InMemoryProxy(backend, binding_marks=True)
    hung = asyncio.Event()
    started: list[MarkKind] = []

    async def post_mark(
        transfer_id: str, mark: MarkKind, actor: str, detail: MarkDetail | None = None
    ) -> None:
        started.append(mark)
        await hung.wait()

    px.event_client.post_mark = post_mark  # type: ignore[method-assign]
    ex = await asyncio.wait_for(px.send(stream=True), 5)
    assert ex.status == 200 and ex.ended
    assert started == [FIRST, END]
    hung.set()
    await px.settle()


async def test_marks_on_a_binding_failed_because_p_pushed_nothing() -> None:
    """P refused the push: the binding is failed and D computes alone; its answer still gets
    first token and end on that binding, so the failed transfer's timeline is complete."""
    refused = Reply.completion("x", kv_transfer_params=push_report(None, "decoder not vouched"))
    backend = MockBackend(
        {"decode": [SSE.after(never()), SSE], "get": Reply.json(BINDING), "prefill": refused}
    )
    px = InMemoryProxy(backend, binding_marks=True)
    ex = await px.send(stream=True)
    assert ex.status == 200 and ex.ended
    await px.settle()
    first, _ = backend.calls_of("decode")
    assert [(m.transfer_id, m.mark) for m in px.marks] == [
        (first.transfer_id, FIRST),
        (first.transfer_id, END),
    ]
    assert [e.outcome for e in px.abandoned] == [BindingState.FAILED]  # no abort of a whole answer


async def test_marks_off_by_default() -> None:
    backend = MockBackend({"decode": SSE, "get": Reply.json(BINDING), "prefill": PUSHED})
    px = InMemoryProxy(backend)
    ex = await px.send(stream=True)
    assert ex.status == 200 and ex.ended
    await px.settle()
    assert px.marks == [] and px.abandoned == []
