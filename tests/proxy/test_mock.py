"""``tests.proxy.mock`` itself: it must fail, time out and record the way the flows' tests
rely on."""

from __future__ import annotations

import asyncio

import pytest

from pdwire.models import BindingState
from proxy.backend import Backend, LegError
from proxy.errors import UpstreamError, UpstreamRejected, UpstreamTimeout, error_json
from proxy.events import EventSink
from tests.proxy.mock import Call, MockBackend, MockEventClient, Outcome, RecordedAbandon, Reply

D = "http://d0:8200"


async def post(
    backend: Backend, leg: str = "decode", url: str = D, timeout_s: float = 1.0
) -> bytes:
    resp = await backend.post(url, "/v1/completions", b"{}", "tid-1", leg, timeout_s)
    try:
        return await resp.read(timeout_s)
    finally:
        resp.close()


async def test_mock_backend_maps_answers_like_a_real_backend() -> None:
    backend = MockBackend(
        {
            "decode": Reply(503, [b"busy"]),
            "prefill": Reply(400, [b'{"error":"bad"}']),
            "get": Reply.json({"detail": "not found"}, status=404),
        }
    )
    with pytest.raises(LegError) as err:
        await post(backend)
    assert (err.value.url, err.value.leg, err.value.retryable) == (D, "decode", True)
    assert err.value.message == f"decode {D}: answered 503: busy"
    with pytest.raises(LegError) as err:
        await post(backend, "prefill")
    assert isinstance(err.value.cause, UpstreamRejected) and err.value.status == 400
    assert not err.value.retryable  # the client's fault: its answer, as an OpenAI error
    assert err.value.body() == error_json("bad", "invalid_request_error", 400)
    assert await backend.get("http://ms/v1/bindings/t", None, 1.0) == (
        404,
        b'{"detail":"not found"}',
    )
    assert [c.outcome for c in backend.calls] == [Outcome.FAILED, Outcome.FAILED, Outcome.ANSWERED]


async def test_mock_backend_fails_and_times_out_where_scripted() -> None:
    backend = MockBackend(
        {
            ("http://d1:8200", "decode"): Reply.fail("refused"),
            "decode": Reply.json({}).after(asyncio.Event()),
            "prefill": Reply(body=[b"{", asyncio.Event(), b"}"]),
            "get": Reply.json({}).after(UpstreamError("metaserver down")),
        }
    )
    with pytest.raises(LegError, match="refused") as err:
        await post(backend, url="http://d1:8200")  # (url, leg) routes win over the leg's
    assert not isinstance(err.value.cause, UpstreamTimeout)
    with pytest.raises(LegError, match=r"no answer in 0.01s") as err:
        await post(backend, timeout_s=0.01)
    assert isinstance(err.value.cause, UpstreamTimeout)
    with pytest.raises(UpstreamTimeout, match="no complete answer in 0.01s"):
        await post(backend, "prefill", timeout_s=0.01)
    with pytest.raises(UpstreamError, match="metaserver down"):
        await backend.get("http://ms/v1/bindings/t", None, 1.0)
    assert [c.outcome for c in backend.calls] == [
        Outcome.FAILED,
        Outcome.FAILED,
        Outcome.CLOSED,
        Outcome.FAILED,
    ]
    assert backend.running == []


async def test_mock_backend_replies_in_order_and_refuses_unscripted_calls() -> None:
    async def echo(call: Call) -> Reply:
        await asyncio.sleep(0)
        return Reply.json({"id": call.request_id, "body": call.json()})

    backend = MockBackend({"decode": [Reply.json(1), Reply.json(2)], "prefill": echo})
    assert [await post(backend), await post(backend)] == [b"1", b"2"]
    with pytest.raises(LookupError, match="no reply left for decode"):
        await post(backend)
    assert await post(backend, "prefill") == b'{"id":"tid-1","body":{}}'
    with pytest.raises(LookupError, match="no route for get"):
        await backend.get("http://ms/v1/bindings/t", None, 1.0)
    backend.route("decode", Reply.json(3))
    assert await post(backend) == b"3"


async def test_mock_backend_records_cancel_release_and_close() -> None:
    gate = asyncio.Event()
    backend = MockBackend(
        {"decode": Reply.sse(["a", gate, "b"]), "prefill": Reply.json({}).after(gate)}
    )
    task = asyncio.get_running_loop().create_task(post(backend, "prefill"))
    pending = await backend.called("prefill", waiting=True)
    assert pending.outcome == Outcome.PENDING and backend.running == [pending]
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert backend.calls[0].outcome == Outcome.CANCELLED and not pending.waiting

    resp = await backend.post(D, "/v1/completions", b"{}", "tid-2", "decode", 1.0)
    call = backend.calls[-1]
    assert (call.outcome, resp.status, resp.content_type) == (
        Outcome.OPEN,
        200,
        b"text/event-stream",
    )
    assert b'"text":"a"' in await resp.next_chunk()
    reading = asyncio.get_running_loop().create_task(resp.next_chunk())
    await backend.called("decode", waiting=True)  # held between the chunks
    gate.set()
    assert b'"text":"b"' in await reading
    assert await resp.next_chunk() == b"data: [DONE]\n\n" and await resp.next_chunk() == b""
    resp.release()
    assert call.outcome == Outcome.RELEASED and backend.running == []
    resp.close()
    assert backend.calls[-1].outcome == Outcome.CLOSED
    with pytest.raises(UpstreamError, match="read after close"):
        await resp.next_chunk()


async def test_mock_event_client_records_drops_through_the_sink() -> None:
    client = MockEventClient()
    sink = EventSink(client)
    sink.abandon("tid-1", BindingState.ABORTED, "client went away")
    sink.abandon("tid-2", BindingState.FAILED)
    await sink.drain(1.0)
    assert client.abandoned == [
        RecordedAbandon("tid-1", BindingState.ABORTED, "proxy", "client went away"),
        RecordedAbandon("tid-2", BindingState.FAILED, "proxy", None),
    ]
