"""The client hanging up at each point of a request, through ``tests.proxy.mock``: every running leg
is cancelled or closed, load and in-flight counts go back to zero, the binding is marked
``aborted``, the request is counted as 499. Both ways a disconnect is noticed are covered: the
hook ``proxy.server``'s protocol calls, and a watcher on ``receive()`` (other servers)."""

from __future__ import annotations

import asyncio
import logging

import pytest

from pdwire.models import BindingState
from proxy.config import Flow
from tests.proxy.inmemory import BINDING, PUSHED, InMemoryProxy, legs, never, wait_until
from tests.proxy.mock import Call, MockBackend, Outcome, RecordedAbandon, Reply

HOOK = pytest.mark.parametrize("hook", [True, False], ids=["server-hook", "receive"])
HELD = pytest.mark.parametrize("in_body", [False, True], ids=["before-headers", "in-body"])


@pytest.fixture(autouse=True)
def _info_logs(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="pdgate.proxy")


async def gone(px: InMemoryProxy, caplog: pytest.LogCaptureFixture) -> None:
    """What every disconnect leaves: nothing sent after the hang-up, a 499, a log line."""
    await px.settle()
    assert px.requests("client_disconnected", 499) == 1
    assert "client went away" in caplog.text


@HOOK
async def test_decode_first_disconnect_during_binding_wait(
    hook: bool, caplog: pytest.LogCaptureFixture
) -> None:
    backend = MockBackend(
        {"decode": Reply.sse(["a"]).after(never()), "get": Reply.json(BINDING).after(never())}
    )
    px = InMemoryProxy(backend)
    ex = px.request(stream=True, hook=hook)
    await backend.called("get", waiting=True)
    d = await backend.called("decode", waiting=True)
    ex.disconnect()
    await ex.done()
    assert ex.messages == []
    assert legs(backend) == [("decode", Outcome.CANCELLED), ("get", Outcome.CANCELLED)]
    assert backend.calls_of("prefill") == []
    await gone(px, caplog)
    assert px.abandoned == [
        RecordedAbandon(d.transfer_id, BindingState.ABORTED, "proxy", "CancelledError")
    ]


@HOOK
async def test_decode_first_disconnect_while_reading_whether_p_took_the_binding(
    hook: bool, caplog: pytest.LogCaptureFixture
) -> None:
    """P's leg broke and the proxy reads the binding to see whether P had taken it; the
    client hangs up during that read: D's leg is dropped and the binding marked failed."""

    def get(call: Call) -> Reply:
        return Reply.json(BINDING) if "wait=" in call.url else Reply.json(BINDING).after(never())

    backend = MockBackend(
        {
            "decode": Reply.sse(["a"]).after(never()),
            "get": get,
            "prefill": Reply.fail("server disconnected"),
        }
    )
    px = InMemoryProxy(backend)
    ex = px.request(stream=True, hook=hook)
    await backend.called("get", count=2, waiting=True)
    d = await backend.called("decode", waiting=True)
    ex.disconnect()
    await ex.done()
    assert ex.messages == []
    assert legs(backend) == [
        ("decode", Outcome.CANCELLED),
        ("get", Outcome.ANSWERED),
        ("get", Outcome.CANCELLED),
        ("prefill", Outcome.FAILED),
    ]
    await gone(px, caplog)
    ((tid, state, _, error),) = px.abandoned
    assert (tid, state) == (d.transfer_id, BindingState.FAILED)
    assert "server disconnected" in str(error)


@HOOK
@HELD
async def test_decode_first_disconnect_during_prefill(
    hook: bool, in_body: bool, caplog: pytest.LogCaptureFixture
) -> None:
    prefill = Reply(body=[never(), b"{}"]) if in_body else PUSHED.after(never())
    backend = MockBackend(
        {"decode": Reply.sse(["a"]).after(never()), "get": Reply.json(BINDING), "prefill": prefill}
    )
    px = InMemoryProxy(backend)
    ex = px.request(stream=True, hook=hook)
    p = await backend.called("prefill", waiting=True)
    await backend.called("decode", waiting=True)
    ex.disconnect()
    await ex.done()
    assert ex.messages == []
    assert legs(backend) == [
        ("decode", Outcome.CANCELLED),
        ("get", Outcome.ANSWERED),
        ("prefill", Outcome.CLOSED if in_body else Outcome.CANCELLED),
    ]
    await gone(px, caplog)
    assert px.abandoned == [
        RecordedAbandon(p.transfer_id, BindingState.ABORTED, "proxy", "CancelledError")
    ]
    assert px.p.circuit.consecutive == 0 and px.d.circuit.consecutive == 0


async def test_decode_first_disconnect_after_decode_answered_during_prefill(
    caplog: pytest.LogCaptureFixture,
) -> None:
    backend = MockBackend(
        {"decode": Reply.sse(["a"]), "get": Reply.json(BINDING), "prefill": PUSHED.after(never())}
    )
    px = InMemoryProxy(backend)
    ex = px.request(stream=True)
    await backend.called("prefill", waiting=True)
    d = await backend.called("decode")
    await wait_until(lambda: d.outcome == Outcome.OPEN)
    ex.disconnect()
    await ex.done()
    assert ex.messages == []
    assert legs(backend) == [
        ("decode", Outcome.CLOSED),
        ("get", Outcome.ANSWERED),
        ("prefill", Outcome.CANCELLED),
    ]
    await gone(px, caplog)
    assert [(e.transfer_id, e.outcome) for e in px.abandoned] == [
        (d.transfer_id, BindingState.ABORTED)
    ]


@HOOK
@HELD
async def test_decode_first_disconnect_waiting_for_first_token(
    hook: bool, in_body: bool, caplog: pytest.LogCaptureFixture
) -> None:
    decode = Reply.sse([never(), "a"]) if in_body else Reply.sse(["a"]).after(never())
    backend = MockBackend({"decode": decode, "get": Reply.json(BINDING), "prefill": PUSHED})
    px = InMemoryProxy(backend)
    ex = px.request(stream=True, hook=hook)
    await backend.called("decode", waiting=True)
    p = await backend.called("prefill")
    await wait_until(lambda: p.outcome == Outcome.RELEASED)  # P is done, D has sent nothing
    ex.disconnect()
    await ex.done()
    assert ex.messages == []
    assert legs(backend) == [
        ("decode", Outcome.CLOSED if in_body else Outcome.CANCELLED),
        ("get", Outcome.ANSWERED),
        ("prefill", Outcome.RELEASED),
    ]
    await gone(px, caplog)
    assert [(e.transfer_id, e.outcome) for e in px.abandoned] == [
        (p.transfer_id, BindingState.ABORTED)
    ]


@HOOK
async def test_decode_first_disconnect_mid_stream_closes_decode(
    hook: bool, caplog: pytest.LogCaptureFixture
) -> None:
    backend = MockBackend(
        {
            "decode": Reply.sse(["Hello", never(), " world"]),
            "get": Reply.json(BINDING),
            "prefill": PUSHED,
        }
    )
    px = InMemoryProxy(backend)
    ex = px.request(stream=True, hook=hook)
    await ex.parts(1)
    assert ex.status == 200 and b"Hello" in ex.body
    ex.disconnect()
    await ex.done()
    assert len(ex.chunks) == 1 and not ex.ended  # nothing more was written to a gone client
    assert legs(backend) == [
        ("decode", Outcome.CLOSED),
        ("get", Outcome.ANSWERED),
        ("prefill", Outcome.RELEASED),
    ]
    await gone(px, caplog)
    (d,) = backend.calls_of("decode")
    assert px.abandoned == [
        RecordedAbandon(d.transfer_id, BindingState.ABORTED, "proxy", "client_disconnected")
    ]


async def test_decode_first_hang_up_after_done_is_not_an_abort() -> None:
    eof = asyncio.Event()  # D has sent [DONE] but not yet ended its body
    decode = Reply.sse(["Hello"])
    decode = Reply(body=[*decode.body, eof], content_type=decode.content_type)
    backend = MockBackend({"decode": decode, "get": Reply.json(BINDING), "prefill": PUSHED})
    px = InMemoryProxy(backend)
    ex = px.request(stream=True)
    await ex.parts(2)
    assert ex.chunks[-1] == b"data: [DONE]\n\n"
    ex.disconnect()  # the client has the whole answer
    await backend.called("decode", waiting=True)
    eof.set()
    await ex.done()
    assert ex.ended and legs(backend)[0] == ("decode", Outcome.RELEASED)
    await px.settle()
    assert px.abandoned == [] and px.requests("ok", 200) == 1


async def test_server_cancel_is_not_taken_for_a_disconnect() -> None:
    """Shutting down cancels the handler too: with the client gone as well, it still ends
    cancelled (the server's cancel is not swallowed), and cleans up all the same."""
    backend = MockBackend(
        {"decode": Reply.sse(["a"]).after(never()), "get": Reply.json(BINDING).after(never())}
    )
    px = InMemoryProxy(backend)
    ex = px.request(stream=True)
    await backend.called("get", waiting=True)
    ex.disconnect()
    ex.task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await ex.task
    assert legs(backend) == [("decode", Outcome.CANCELLED), ("get", Outcome.CANCELLED)]
    await px.settle()


async def test_prefill_first_disconnect_during_prefill(caplog: pytest.LogCaptureFixture) -> None:
    backend = MockBackend({"prefill": Reply.completion(kv_transfer_params={}).after(never())})
    px = InMemoryProxy(backend, flow=Flow.PREFILL_FIRST)
    ex = px.request()
    await backend.called("prefill", waiting=True)
    ex.disconnect()
    await ex.done()
    assert ex.messages == []
    assert legs(backend) == [("prefill", Outcome.CANCELLED)]
    await gone(px, caplog)
    assert px.abandoned == []


async def test_decode_first_disconnect_after_absorbed_decode_answer(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """D answered during the binding wait (its cancel of the request was absorbed): a later
    hang-up is still the client's own cancel, seen as such."""
    backend = MockBackend(
        {
            "decode": Reply.sse(["Hello", never(), " world"]),
            "get": Reply.json(BINDING).after(never()),
        }
    )
    px = InMemoryProxy(backend)
    ex = px.request(stream=True)
    await ex.parts(1)
    ex.disconnect()
    await ex.done()
    assert legs(backend) == [("decode", Outcome.CLOSED), ("get", Outcome.CANCELLED)]
    await gone(px, caplog)


async def test_decode_first_disconnect_during_retry(caplog: pytest.LogCaptureFixture) -> None:
    backend = MockBackend(
        {
            "decode": [Reply.fail("D died"), Reply.sse(["a"]).after(never())],
            "get": Reply.json(BINDING).after(never()),
        }
    )
    px = InMemoryProxy(backend, retries=1)
    ex = px.request(stream=True)
    await backend.called("decode", count=2, waiting=True)  # the second attempt
    ex.disconnect()
    await ex.done()
    assert ex.messages == []
    first, second = backend.calls_of("decode")
    assert (first.outcome, second.outcome) == (Outcome.FAILED, Outcome.CANCELLED)
    assert [c.outcome for c in backend.calls_of("get")] == [Outcome.CANCELLED] * 2
    await gone(px, caplog)
    assert [(e.transfer_id, e.outcome) for e in px.abandoned] == [
        (first.transfer_id, BindingState.ABORTED),
        (second.transfer_id, BindingState.ABORTED),
    ]
