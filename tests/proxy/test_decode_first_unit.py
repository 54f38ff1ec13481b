"""decode-first through ``tests.proxy.mock``: the happy paths and every cancel path of
``proxy/flows/decode_first.py`` (D failing or answering during the binding wait and during P's
leg, P refusing the push, the client hanging up at each point), in memory, in milliseconds."""

from __future__ import annotations

import asyncio

import pytest

from pdwire.models import BindingState
from pdwire.params import decode_leg, push_report
from proxy.config import Flow
from proxy.errors import UpstreamTimeout
from proxy.flows import bindings
from proxy.flows.bindings import ANSWER_MARGIN_S, POLL_S, TAKEN_READ_S
from tests.proxy.inmemory import (
    BINDING,
    D_URL,
    MS_URL,
    P_URL,
    PUSHED,
    SSE,
    InMemoryProxy,
    legs,
    never,
    sse_text,
    wait_until,
)
from tests.proxy.mock import Call, MockBackend, Outcome, RecordedAbandon, Reply
from tests.proxy.test_pairing_unit import registered

ABORTED, FAILED = BindingState.ABORTED, BindingState.FAILED


async def test_decode_first_nonstream_sends_binding_to_prefill() -> None:
    usage_d = {"prompt_tokens": 40, "completion_tokens": 4}
    usage_p = {"prompt_tokens": 40, "prompt_tokens_details": {"cached_tokens": 16}}
    backend = MockBackend(
        {
            "decode": Reply.completion("hi", usage=usage_d),
            "get": Reply.json(BINDING),
            "prefill": Reply.completion(
                "x", kv_transfer_params=push_report(None, None), usage=usage_p
            ),
        }
    )
    px = InMemoryProxy(backend, metaserver_token="s3cret")
    ex = await px.send()
    assert ex.status == 200
    assert ex.json()["choices"][0]["text"] == "hi"
    assert ex.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 16  # P's count
    (get,) = backend.calls_of("get")
    (d,) = backend.calls_of("decode", D_URL)
    (p,) = backend.calls_of("prefill", P_URL)
    tid = d.transfer_id
    assert p.transfer_id == tid and tid.startswith("pd-")
    # P and D share one request id, which names D's answer: not the transfer id, which the
    # client never sees
    assert p.request_id == d.request_id != tid and tid not in ex.body.decode()
    assert get.url.startswith(f"{MS_URL}/v1/bindings/{tid}?wait=")
    assert get.headers == {"authorization": "Bearer s3cret"}
    assert backend.calls[-1] is p  # P only once the binding is in
    assert d.json()["kv_transfer_params"] == decode_leg(tid, MS_URL)
    kv_p = p.json()["kv_transfer_params"]
    assert kv_p == {
        "do_remote_decode": True,
        "transfer_id": tid,
        "metaserver": MS_URL,
        "decode": BINDING,
    }
    assert p.json()["max_tokens"] == 1 and p.json()["stream"] is False
    s = px.settings
    assert (d.timeout_s, p.timeout_s) == (s.request_timeout_s, s.prefill_timeout_s)
    assert get.timeout_s == min(s.binding_wait_s, POLL_S) + ANSWER_MARGIN_S  # one piece
    assert legs(backend) == [
        ("decode", Outcome.RELEASED),
        ("get", Outcome.ANSWERED),
        ("prefill", Outcome.RELEASED),
    ]
    await px.settle()
    assert px.abandoned == []
    assert px.requests("ok", 200) == 1
    assert px.d.circuit.consecutive == 0 and px.d.served == 1 and px.p.served == 1


async def test_decode_first_stream_relays_decode_chunks() -> None:
    backend = MockBackend({"decode": SSE, "get": Reply.json(BINDING), "prefill": PUSHED})
    px = InMemoryProxy(backend)
    ex = await px.send(stream=True)
    assert ex.status == 200 and ex.headers[b"content-type"] == b"text/event-stream"
    assert ex.ended and sse_text(ex.body) == "Hello world"
    assert ex.body.endswith(b"data: [DONE]\n\n")
    (d,) = backend.calls_of("decode")
    assert d.json()["stream"] is True and d.timeout_s == px.settings.first_token_timeout_s
    assert d.outcome == Outcome.RELEASED and d.response is not None
    assert d.response.chunks_read == 3
    await px.settle()
    assert px.abandoned == [] and px.requests("ok", 200) == 1


async def test_concurrent_sends_prefill_at_once_without_binding() -> None:
    p_gate = asyncio.Event()
    backend = MockBackend({"decode": SSE, "prefill": PUSHED.after(p_gate)})  # no "get" route
    px = InMemoryProxy(backend, flow=Flow.CONCURRENT)
    ex = px.request(stream=True)
    p = await backend.called("prefill", waiting=True)
    assert p.json()["kv_transfer_params"] == {
        "do_remote_decode": True,
        "transfer_id": p.transfer_id,
        "metaserver": MS_URL,
    }
    p_gate.set()
    await ex.done()
    assert ex.status == 200 and sse_text(ex.body) == "Hello world"
    assert backend.calls_of("get") == []
    await px.settle()


async def test_decode_first_decode_failure_during_binding_wait_aborts(
    caplog: pytest.LogCaptureFixture,
) -> None:
    d_gate = asyncio.Event()
    backend = MockBackend(
        {
            "decode": Reply.fail("D died").after(d_gate),
            "get": Reply.json(BINDING).after(never()),
            "prefill": PUSHED,
        }
    )
    px = InMemoryProxy(backend)
    ex = px.request()
    await backend.called("get", waiting=True)
    d = await backend.called("decode", waiting=True)
    d_gate.set()
    await ex.done()
    assert ex.status == 502
    assert ex.json()["error"]["message"] == "the decode leg failed"  # no address to a client
    assert legs(backend) == [("decode", Outcome.FAILED), ("get", Outcome.CANCELLED)]
    await px.settle()
    tid = d.transfer_id
    assert px.abandoned == [RecordedAbandon(tid, ABORTED, "proxy", f"decode {D_URL}: D died")]
    assert px.d.circuit.consecutive == 1 and px.p.circuit.consecutive == 0
    assert (
        f"attempt failed tid={tid} engine_request_id={d.request_id} flow=decode-first leg=decode"
        in caplog.text
    )
    assert px.requests("upstream_error", 502) == 1


async def test_decode_first_decode_failure_during_prefill_cancels_prefill() -> None:
    d_gate = asyncio.Event()
    backend = MockBackend(
        {
            "decode": Reply.fail("D died").after(d_gate),
            "get": Reply.json(BINDING),
            "prefill": PUSHED.after(never()),
        }
    )
    px = InMemoryProxy(backend)
    ex = px.request(stream=True)
    await backend.called("prefill", waiting=True)
    d = await backend.called("decode", waiting=True)
    d_gate.set()
    await ex.done()
    assert ex.status == 502 and ex.json()["error"]["message"] == "the decode leg failed"
    assert legs(backend) == [
        ("decode", Outcome.FAILED),
        ("get", Outcome.ANSWERED),
        ("prefill", Outcome.CANCELLED),
    ]
    await px.settle()
    assert px.abandoned == [
        RecordedAbandon(d.transfer_id, ABORTED, "proxy", f"decode {D_URL}: D died")
    ]
    assert px.p.circuit.consecutive == 0  # P is not to blame


async def test_decode_first_decode_answer_during_binding_wait_skips_prefill() -> None:
    backend = MockBackend({"decode": SSE, "get": Reply.json(BINDING).after(never())})
    px = InMemoryProxy(backend)
    ex = await px.send(stream=True)
    assert ex.status == 200 and sse_text(ex.body) == "Hello world"
    assert legs(backend) == [("decode", Outcome.RELEASED), ("get", Outcome.CANCELLED)]
    assert backend.calls_of("prefill") == []
    await px.settle()
    assert px.abandoned == []


async def test_decode_first_decode_answer_before_prefill_ends_is_kept() -> None:
    p_gate = asyncio.Event()
    backend = MockBackend(
        {"decode": SSE, "get": Reply.json(BINDING), "prefill": PUSHED.after(p_gate)}
    )
    px = InMemoryProxy(backend)
    ex = px.request(stream=True)
    await backend.called("prefill", waiting=True)
    d = await backend.called("decode")
    await wait_until(lambda: d.outcome == Outcome.OPEN)  # D's first chunk is in
    assert not ex.task.done() and ex.status is None  # still waiting for P
    p_gate.set()
    await ex.done()
    assert ex.status == 200 and sse_text(ex.body) == "Hello world"
    assert legs(backend) == [
        ("decode", Outcome.RELEASED),
        ("get", Outcome.ANSWERED),
        ("prefill", Outcome.RELEASED),
    ]
    await px.settle()
    assert px.abandoned == []


@pytest.mark.parametrize("stream", [True, False], ids=["sse", "json"])
async def test_decode_first_prefill_silent_past_the_grace_is_dropped(
    stream: bool, caplog: pytest.LogCaptureFixture
) -> None:
    """A frozen P (its answer never comes) holds D's answer only ``prefill_grace_s``: then P's
    leg is cancelled and D's answer goes out, without P's cached-token count."""
    usage_d = {"prompt_tokens": 40, "completion_tokens": 4}
    backend = MockBackend(
        {
            "decode": SSE if stream else Reply.completion("hi", usage=usage_d),
            "get": Reply.json(BINDING),
            "prefill": PUSHED.after(never()),
        }
    )
    px = InMemoryProxy(backend, prefill_grace_s=0.05)
    ex = await px.send(stream=stream)
    assert ex.status == 200
    if stream:
        assert sse_text(ex.body) == "Hello world"
    else:
        assert ex.json()["choices"][0]["text"] == "hi"
        assert "prompt_tokens_details" not in ex.json()["usage"]  # P's count never came
    assert legs(backend) == [
        ("decode", Outcome.RELEASED),
        ("get", Outcome.ANSWERED),
        ("prefill", Outcome.CANCELLED),
    ]
    assert px.metric("pd_prefill_dropped_total") == 1.0
    assert "its leg dropped" in caplog.text
    await px.settle()
    assert px.abandoned == []  # P's connector and D report the transfer's end themselves


async def test_decode_first_prefill_answering_within_the_grace_is_merged() -> None:
    p_gate = asyncio.Event()
    usage_p = {"prompt_tokens": 40, "prompt_tokens_details": {"cached_tokens": 16}}
    pushed = Reply.completion("x", kv_transfer_params=push_report(None, None), usage=usage_p)
    backend = MockBackend(
        {
            "decode": Reply.completion("hi", usage={"prompt_tokens": 40}),
            "get": Reply.json(BINDING),
            "prefill": pushed.after(p_gate),
        }
    )
    px = InMemoryProxy(backend, prefill_grace_s=30)
    ex = px.request()
    d = await backend.called("decode")
    await wait_until(lambda: d.outcome == Outcome.OPEN)  # D's answer is in; P is not
    await backend.called("prefill", waiting=True)
    p_gate.set()
    await ex.done()
    assert ex.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 16
    assert backend.calls_of("prefill")[0].outcome == Outcome.RELEASED
    assert px.metric("pd_prefill_dropped_total") == 0.0
    await px.settle()


def sent_plain(backend: MockBackend) -> str:
    """D's first request (with the KV transfer) was dropped and D got the plain one, under the
    same id: the transfer id."""
    first, second = backend.calls_of("decode")
    tid = first.transfer_id
    assert first.outcome == Outcome.CANCELLED and second.outcome == Outcome.RELEASED
    assert first.json()["kv_transfer_params"] == decode_leg(tid, MS_URL)
    assert "kv_transfer_params" not in second.json() and second.request_id == first.request_id
    return tid


async def test_decode_first_no_push_sends_decode_the_plain_request(
    caplog: pytest.LogCaptureFixture,
) -> None:
    refused = Reply.completion("x", kv_transfer_params=push_report(None, "decoder not vouched"))
    backend = MockBackend(
        {
            "decode": [SSE.after(never()), SSE],  # the first one waits for KV that never comes
            "get": Reply.json(BINDING),
            "prefill": refused,
        }
    )
    px = InMemoryProxy(backend)
    ex = await px.send(stream=True)
    assert ex.status == 200 and sse_text(ex.body) == "Hello world"
    tid = sent_plain(backend)
    await px.settle()
    assert px.abandoned == [
        RecordedAbandon(tid, FAILED, "proxy", "P pushed nothing: decoder not vouched")
    ]
    assert px.metric("pd_prefill_no_push_total") == 1.0
    assert f"{tid}: P pushed nothing (decoder not vouched); D computes" in caplog.text


async def test_decode_first_no_push_after_decode_answered_keeps_answer() -> None:
    p_gate = asyncio.Event()
    refused = Reply.completion("x", kv_transfer_params=push_report(None, "too late"))
    backend = MockBackend(
        {"decode": SSE, "get": Reply.json(BINDING), "prefill": refused.after(p_gate)}
    )
    px = InMemoryProxy(backend)
    ex = px.request(stream=True)
    await backend.called("prefill", waiting=True)
    d = await backend.called("decode")
    await wait_until(lambda: d.outcome == Outcome.OPEN)
    p_gate.set()
    await ex.done()
    assert ex.status == 200 and sse_text(ex.body) == "Hello world"
    assert len(backend.calls_of("decode")) == 1  # no plain request: D did not wait
    await px.settle()
    assert px.abandoned == [] and px.metric("pd_prefill_no_push_total") == 0.0


async def test_decode_first_prefill_error_marks_binding_failed() -> None:
    backend = MockBackend(
        {
            "decode": SSE.after(never()),
            "get": Reply.json(BINDING),
            "prefill": Reply(503, [b"overloaded"]),
        }
    )
    px = InMemoryProxy(backend)
    ex = await px.send(stream=True)
    assert ex.status == 502 and ex.json()["error"]["message"] == "the prefill leg failed"
    assert legs(backend) == [
        ("decode", Outcome.CANCELLED),
        ("get", Outcome.ANSWERED),  # the binding
        ("get", Outcome.ANSWERED),  # did P take it? No (no events): P refused, D is dropped
        ("prefill", Outcome.FAILED),
    ]
    await px.settle()
    ((tid, state, _, error),) = px.abandoned
    assert tid == backend.calls_of("decode")[0].transfer_id
    assert state == FAILED and str(error).startswith(f"prefill {P_URL}: ")  # operators'
    assert "overloaded" in str(error)
    assert px.p.circuit.consecutive == 1 and px.d.circuit.consecutive == 0


TAKEN = {**BINDING, "events": [{"state": "prefill_started", "actor": "p0", "at": 1.0}]}


def binding_then_taken(call: Call) -> Reply:
    """The long-poll finds D's binding; the read after P's leg failed finds P took it."""
    return Reply.json(BINDING if "wait=" in call.url else TAKEN)


def plain_decode_answers(call: Call) -> Reply:
    """D's request with a KV transfer waits for KV that never comes; the plain one answers."""
    return SSE.after(never()) if "kv_transfer_params" in call.json() else SSE


async def test_decode_first_prefill_failing_after_taking_the_binding_lets_decode_compute(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """P's leg breaks (P killed) after P took the binding: D's first request waits for KV a
    dead P will not finish, and a retry's P would prefill from scratch. D gets the plain
    request; P is charged as for a failed attempt."""
    backend = MockBackend(
        {
            "decode": plain_decode_answers,
            "get": binding_then_taken,
            "prefill": Reply.fail("server disconnected"),
        }
    )
    px = InMemoryProxy(backend)
    ex = await px.send(stream=True)
    assert ex.status == 200 and sse_text(ex.body) == "Hello world"
    tid = sent_plain(backend)
    _, read = backend.calls_of("get")
    assert read.url == f"{MS_URL}/v1/bindings/{tid}" and read.timeout_s == TAKEN_READ_S
    await px.settle()
    why = f"prefill {P_URL}: server disconnected"
    assert px.abandoned == [
        RecordedAbandon(tid, FAILED, "proxy", f"P failed after taking the binding: {why}")
    ]
    assert px.metric("pd_decode_without_prefill_total", reason="prefill_failed") == 1.0
    assert px.p.circuit.consecutive == 1 and px.d.circuit.consecutive == 0
    assert f"{tid}: P failed after taking the binding ({why}); D computes" in caplog.text


async def test_decode_first_prefill_rejecting_the_request_is_passed_through() -> None:
    """A 4xx from P is the request's fault: the client gets it, whatever the binding says."""
    backend = MockBackend(
        {
            "decode": plain_decode_answers,
            "get": binding_then_taken,
            "prefill": Reply(400, [b'{"error": {"message": "bad prompt"}}']),
        }
    )
    px = InMemoryProxy(backend)
    ex = await px.send()
    assert ex.status == 400 and len(backend.calls_of("decode")) == 1
    await px.settle()
    assert px.metric("pd_decode_without_prefill_total", reason="prefill_failed") is None


async def test_decode_first_missing_binding_is_504_and_aborts() -> None:
    backend = MockBackend({"decode": SSE.after(never()), "get": Reply.json({}, status=404)})
    px = InMemoryProxy(backend)
    ex = await px.send()
    assert ex.status == 504 and ex.json()["error"]["type"] == "binding_timeout"
    assert legs(backend) == [("decode", Outcome.CANCELLED), ("get", Outcome.ANSWERED)]
    await px.settle()
    ((tid, state, _, error),) = px.abandoned
    assert state == ABORTED and f"no binding for {tid}" in str(error)
    assert px.d.circuit.consecutive == 1  # D never wrote it


async def test_decode_first_retry_uses_new_transfer_id() -> None:
    backend = MockBackend(
        {
            "decode": [Reply.fail("D died"), SSE],
            "get": [Reply.json(BINDING).after(never()), Reply.json(BINDING)],
            "prefill": PUSHED,
        }
    )
    px = InMemoryProxy(backend, retries=1)
    ex = await px.send(stream=True)
    assert ex.status == 200 and sse_text(ex.body) == "Hello world"
    first, second = backend.calls_of("decode")
    (p,) = backend.calls_of("prefill")
    assert first.transfer_id != second.transfer_id == p.transfer_id
    assert first.request_id != second.request_id == p.request_id
    await px.settle()
    assert [(e.transfer_id, e.outcome) for e in px.abandoned] == [(first.transfer_id, ABORTED)]
    assert px.metric("pd_retries_total", reason="upstream_error") == 1.0
    assert px.d.circuit.consecutive == 0  # the success closed it again


async def test_decode_first_decode_failure_as_binding_arrives_cancels_prefill() -> None:
    gate = asyncio.Event()  # the binding and D's failure land in the same loop iteration
    backend = MockBackend(
        {
            "decode": Reply.fail("D died").after(gate),
            "get": Reply.json(BINDING).after(gate),
            "prefill": PUSHED.after(never()),
        }
    )
    px = InMemoryProxy(backend)
    ex = px.request()
    await backend.called("get", waiting=True)
    await backend.called("decode", waiting=True)
    gate.set()
    await ex.done()
    assert ex.status == 502
    assert legs(backend) == [
        ("decode", Outcome.FAILED),
        ("get", Outcome.ANSWERED),
        ("prefill", Outcome.CANCELLED),
    ]
    await px.settle()
    assert [e.outcome for e in px.abandoned] == [ABORTED]


async def test_decode_first_first_token_timeout_is_504(caplog: pytest.LogCaptureFixture) -> None:
    backend = MockBackend(
        {"decode": Reply.sse([never(), "late"]), "get": Reply.json(BINDING), "prefill": PUSHED}
    )
    px = InMemoryProxy(backend, first_token_timeout_s=0.01)
    ex = await px.send(stream=True)
    assert ex.status == 504
    assert ex.json()["error"]["message"] == "the decode leg did not answer in time"
    assert f"decode {D_URL}: no first byte in 0.01s" in caplog.text  # the operator's detail
    assert legs(backend) == [
        ("decode", Outcome.CLOSED),
        ("get", Outcome.ANSWERED),
        ("prefill", Outcome.RELEASED),
    ]
    await px.settle()
    assert [e.outcome for e in px.abandoned] == [ABORTED]


async def test_decode_first_counts_binding_waits_and_transfers_in_flight() -> None:
    bound, pushed = asyncio.Event(), asyncio.Event()
    backend = MockBackend(
        {
            "decode": Reply.completion("hi").after(pushed),
            "get": Reply.json(BINDING).after(bound),
            "prefill": PUSHED,
        }
    )
    px = InMemoryProxy(backend)
    ex = px.request()
    await backend.called("get", waiting=True)
    assert px.metric("pd_binding_waits") == 1  # D has not bound yet
    assert px.metric("pd_transfers_inflight") == 1
    bound.set()
    await backend.called("prefill")
    await wait_until(lambda: px.metric("pd_binding_waits") == 0)
    assert px.metric("pd_transfers_inflight") == 1  # P pushed; D's first byte not in yet
    assert px.metric("pd_binding_wait_seconds_count") == 1
    pushed.set()
    await ex.done()
    assert ex.status == 200
    assert px.metric("pd_transfers_inflight") == 0
    assert px.metric("pd_transfer_oldest_age_seconds") == 0
    await px.settle()


@pytest.mark.parametrize(
    ("metaserver", "why"),
    [
        (Reply.fail(), "connection refused"),
        (Reply(before=[UpstreamTimeout("no answer in 10.0s")]), "no answer in 10.0s"),
        (Reply(503, [b"store down"]), "metaserver answered 503: store down"),
    ],
    ids=["refused", "frozen", "5xx"],
)
async def test_decode_first_unreadable_binding_sends_decode_the_plain_request(
    metaserver: Reply, why: str, caplog: pytest.LogCaptureFixture
) -> None:
    # D's answers by body, not by order: a refused read can fail before D's first call is
    # answered
    backend = MockBackend({"decode": plain_decode_answers, "get": metaserver, "prefill": PUSHED})
    px = InMemoryProxy(backend)
    ex = await px.send(stream=True)
    assert ex.status == 200 and sse_text(ex.body) == "Hello world"
    tid = sent_plain(backend)
    assert backend.calls_of("prefill") == []
    assert px.metric("pd_binding_waits") == 0
    assert px.metric("pd_transfers_inflight") == 0
    await px.settle()
    assert px.abandoned == [RecordedAbandon(tid, FAILED, "proxy", f"binding unreadable: {why}")]
    assert px.metric("pd_decode_without_prefill_total", reason="binding_unreadable") == 1.0
    assert px.metric("pd_prefill_no_push_total") == 0.0
    assert f"{tid}: binding unreadable ({why}); D computes the prompt itself" in caplog.text


async def test_decode_first_binding_naming_another_decode_is_not_sent_to_prefill(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The binding for this transfer names another registered decode than the one the request
    went to (written by someone else under this id): P is never sent it, D computes alone."""
    foreign = {**BINDING, "decode_instance_id": "d-other"}
    backend = MockBackend(
        {"decode": plain_decode_answers, "get": Reply.json(foreign), "prefill": PUSHED}
    )
    px = InMemoryProxy(backend)
    px.runtime.registry.apply_registry([registered("d0", "decode", D_URL, "v1")])
    ex = await px.send(stream=True)
    assert ex.status == 200 and sse_text(ex.body) == "Hello world"
    tid = sent_plain(backend)
    assert backend.calls_of("prefill") == []
    await px.settle()
    why = "binding names another decode: it names d-other, d0 was chosen"
    assert px.abandoned == [RecordedAbandon(tid, FAILED, "proxy", why)]
    assert px.metric("pd_decode_without_prefill_total", reason="binding_foreign") == 1.0
    # the binding of the chosen decode goes to P as before
    backend.route("get", Reply.json(BINDING))
    backend.route("decode", SSE)
    assert (await px.send(stream=True)).status == 200 and len(backend.calls_of("prefill")) == 1
    # ... telling P which decode was chosen: P checks the binding it pushes into names it
    (p,) = backend.calls_of("prefill")
    assert p.json()["kv_transfer_params"]["decode_instance"] == "d0"


async def test_decode_first_metaserver_refusing_the_read_is_an_error(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A 4xx on the binding read (a wrong token, say) is a deployment error, not an outage:
    the client gets it, and D is not silently sent every prompt."""
    backend = MockBackend(
        {"decode": SSE.after(never()), "get": Reply(401, [b"bad token"]), "prefill": PUSHED}
    )
    px = InMemoryProxy(backend)
    ex = await px.send()
    assert ex.status == 502 and ex.json()["error"]["message"] == "the binding leg failed"
    assert "metaserver answered 401: bad token" in caplog.text  # the operator's detail
    assert len(backend.calls_of("decode")) == 1 and backend.calls_of("prefill") == []
    await px.settle()
    assert px.metric("pd_decode_without_prefill_total", reason="binding_unreadable") is None


async def test_decode_first_long_poll_asks_again_after_each_piece(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The binding wait is read in pieces of at most ``POLL_S``, each with its own answer
    deadline: a 404 after a waited piece asks again while time is left."""
    monkeypatch.setattr(bindings, "POLL_S", 0.1)
    backend = MockBackend(
        {
            "decode": SSE.after(0.5),  # D streams once P has pushed (well after both reads)
            "get": [Reply.json({}, status=404).after(0.1), Reply.json(BINDING)],
            "prefill": PUSHED,
        }
    )
    px = InMemoryProxy(backend, binding_wait_s=5.0)
    ex = await px.send(stream=True)
    assert ex.status == 200
    first, second = backend.calls_of("get")
    assert "wait=0.1" in first.url and first.timeout_s == 0.1 + ANSWER_MARGIN_S
    assert "wait=0.1" in second.url
    assert len(backend.calls_of("prefill")) == 1
    await px.settle()
