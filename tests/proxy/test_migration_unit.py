"""Mid-stream migration in memory (``proxy.migration``): D breaks after the client has part of
a streamed answer, and the answer goes on from another pair — one id, the right prompt ids and
budgets in the continuation, ids hidden unless asked, usage summed — or, where replay would not
be exact, ends with an error event as before. The events are shaped as vLLM 0.32 sends them
with ``return_token_ids`` (``vllm/entrypoints/openai/completion/serving.py`` and
``chat_completion/serving.py``: ``prompt_token_ids`` on the first chunk, ``token_ids`` on each,
``null`` when not asked)."""

from __future__ import annotations

from typing import Any

import msgspec

from pdwire.models import MarkKind
from proxy.config import Flow
from proxy.errors import UpstreamError
from proxy.migration import Tape, hide_ids
from tests.proxy.inmemory import BINDING, D_URL, P_URL, PUSHED, InMemoryProxy, never
from tests.proxy.mock import MockBackend, Outcome, Reply, Step

D2_URL = "http://d1:8201"
PROMPT_IDS = [101, 102, 103, 104]
HEAD = {"id": "cmpl-first", "created": 1700000000, "model": "m"}


def completion_event(
    text: str, ids: list[int], *, first: bool = False, finish: str | None = None, **head: Any
) -> bytes:
    choice = {
        "index": 0, "text": text, "logprobs": None, "finish_reason": finish, "stop_reason": None,
        "prompt_token_ids": PROMPT_IDS if first else None, "token_ids": ids,
    }  # fmt: skip
    obj = {**HEAD, **head, "object": "text_completion", "choices": [choice]}
    return b"data: " + msgspec.json.encode(obj) + b"\n\n"


def chat_event(text: str | None, ids: list[int] | None, finish: str | None = None) -> bytes:
    delta: dict[str, Any] = {"role": "assistant", "content": ""} if text is None else {
        "content": text}  # fmt: skip
    obj: dict[str, Any] = {
        **HEAD, "object": "chat.completion.chunk",
        "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish,
                     "token_ids": ids}],
    }  # fmt: skip
    if text is None:
        obj["prompt_token_ids"] = PROMPT_IDS
    return b"data: " + msgspec.json.encode(obj) + b"\n\n"


def usage_event(prompt: int, completion: int, **head: Any) -> bytes:
    u = {"prompt_tokens": prompt, "completion_tokens": completion,
         "total_tokens": prompt + completion}  # fmt: skip
    obj = {**HEAD, **head, "object": "text_completion", "choices": [], "usage": u}
    return b"data: " + msgspec.json.encode(obj) + b"\n\n"


DONE = b"data: [DONE]\n\n"
CUT = UpstreamError("connection reset by peer")


def stream(*steps: Step) -> Reply:
    return Reply(200, steps, content_type=b"text/event-stream")


def events(body: bytes) -> list[dict[str, Any]]:
    out = []
    for e in body.split(b"\n\n"):
        if e.startswith(b"data: {"):
            out.append(msgspec.json.decode(e[6:]))
    return out


def text_of(objs: list[dict[str, Any]], chat: bool = False) -> str:
    pieces = []
    for o in objs:
        for c in o.get("choices", []):
            pieces.append((c["delta"].get("content") or "") if chat else c["text"])
    return "".join(pieces)


def two_decoders(d0: Reply, d1: Reply, **settings: Any) -> tuple[MockBackend, InMemoryProxy]:
    """Two D, one P; the first D called gets ``d0``, the next ``d1``."""
    backend = MockBackend({"prefill": PUSHED, "decode": [d0, d1]})
    px = InMemoryProxy(backend, Flow.PREFILL_FIRST, decode=[D_URL, D2_URL], **settings)
    return backend, px


async def test_a_completion_broken_mid_stream_goes_on_from_another_pair() -> None:
    first = stream(completion_event("The", [11], first=True), completion_event(" cat", [12]), CUT)
    rest = stream(
        completion_event(" sat", [13], first=True, id="cmpl-second", created=5),
        completion_event(".", [14], finish="length", id="cmpl-second", created=5),
        usage_event(6, 2, id="cmpl-second", created=5),
        DONE,
    )
    backend, px = two_decoders(first, rest)
    ex = await px.request(
        stream=True, extra={"prompt": PROMPT_IDS, "stream_options": {"include_usage": True}}
    ).done()
    assert ex.status == 200 and ex.ended and ex.body.endswith(DONE)
    objs = events(ex.body)
    assert text_of(objs) == "The cat sat."
    assert {o["id"] for o in objs} == {"cmpl-first"} and {o["created"] for o in objs} == {
        HEAD["created"]
    }
    assert b"error" not in ex.body
    # the client did not ask for ids: every one it sees is null, as vLLM would send
    assert all(c["token_ids"] is None and c["prompt_token_ids"] is None
               for o in objs for c in o["choices"])  # fmt: skip
    assert objs[-1]["usage"] == {"prompt_tokens": 4, "completion_tokens": 4, "total_tokens": 8}
    # the continuation: prompt ids and the two tokens sent, 2 of 4 tokens left, disaggregated
    d0, d1 = backend.calls_of("decode")
    assert d0.json()["return_token_ids"] is True
    assert d0.outcome == Outcome.CLOSED and d1.url != d0.url  # the broken D is avoided
    cont = d1.json()
    assert d1.path == "/v1/completions"
    assert cont["prompt"] == [*PROMPT_IDS, 11, 12] and cont["max_tokens"] == 2
    assert [c.url for c in backend.calls_of("prefill")] == [P_URL, P_URL]
    assert backend.calls_of("prefill")[1].json()["prompt"] == [*PROMPT_IDS, 11, 12]
    assert px.metric("pd_migrations_total", reason="broken", outcome="continued") == 1.0
    assert px.requests("ok", 200) == 1
    broken = next(i for i in px.runtime.registry.instances() if i.url == d0.url)
    assert broken.circuit.consecutive == 1
    await px.settle()


async def test_a_chat_answer_goes_on_in_the_chat_shape() -> None:
    first = stream(chat_event(None, None), chat_event("Hi", [21]), CUT)
    rest = stream(
        completion_event(" there", [22], first=True), completion_event("!", [23], finish="stop"),
        DONE,
    )  # fmt: skip
    backend, px = two_decoders(first, rest)
    ex = await px.request(stream=True, chat=True, extra={"max_tokens": 10, "seed": 7}).done()
    objs = events(ex.body)
    assert text_of(objs, chat=True) == "Hi there!"
    assert {o["object"] for o in objs} == {"chat.completion.chunk"}
    assert {o["id"] for o in objs} == {"cmpl-first"}
    assert objs[-1]["choices"][0]["finish_reason"] == "stop"
    assert objs[0].get("prompt_token_ids") is None  # hidden from a client that did not ask
    cont = backend.calls_of("decode")[1].json()
    assert cont["prompt"] == [*PROMPT_IDS, 21] and cont["max_tokens"] == 9
    assert cont["seed"] == 7 and "messages" not in cont
    await px.settle()


async def test_the_client_keeps_the_ids_it_asked_for() -> None:
    first = stream(completion_event("a", [1], first=True), CUT)
    rest = stream(completion_event("b", [2], first=True, finish="length"), DONE)
    _, px = two_decoders(first, rest)
    ex = await px.request(
        stream=True, extra={"prompt": PROMPT_IDS, "return_token_ids": True}
    ).done()
    objs = events(ex.body)
    assert [c["token_ids"] for o in objs for c in o["choices"]] == [[1], [2]]
    assert objs[0]["choices"][0]["prompt_token_ids"] == PROMPT_IDS
    assert objs[1]["choices"][0]["prompt_token_ids"] is None  # said once, as by one D
    await px.settle()


async def test_tokens_whose_text_was_not_sent_are_generated_again() -> None:
    """A token that ends inside a UTF-8 character comes with no text: the continuation starts
    before it, so the client's text and the replayed ids agree."""
    first = stream(completion_event("x", [1], first=True), completion_event("", [2]), CUT)
    rest = stream(
        completion_event("", [2], first=True), completion_event("é", [3], finish="length"),
        usage_event(5, 2), DONE,
    )  # fmt: skip
    backend, px = two_decoders(first, rest)
    ex = await px.request(
        stream=True,
        extra={"prompt": PROMPT_IDS, "return_token_ids": True,
               "stream_options": {"include_usage": True}},
    ).done()  # fmt: skip
    objs = events(ex.body)
    assert text_of(objs) == "xé"
    # token 2's id came with the first D's answer: the continuation's copy of it is cut
    assert [i for o in objs for c in o["choices"] for i in c["token_ids"]] == [1, 2, 3]
    assert objs[-1]["usage"]["completion_tokens"] == 3
    assert backend.calls_of("decode")[1].json()["prompt"] == [*PROMPT_IDS, 1]
    await px.settle()


async def test_a_frozen_decoder_is_left_after_the_idle_timeout() -> None:
    first = stream(completion_event("a", [1], first=True), never())
    rest = stream(completion_event("b", [2], first=True, finish="length"), DONE)
    backend = MockBackend({"prefill": PUSHED, "decode": [first, rest]}, idle_timeout_s=0.05)
    px = InMemoryProxy(backend, Flow.PREFILL_FIRST, decode=[D_URL, D2_URL])
    ex = await px.request(stream=True, extra={"prompt": PROMPT_IDS}).done()
    assert text_of(events(ex.body)) == "ab"
    assert px.metric("pd_migrations_total", reason="timeout", outcome="continued") == 1.0
    await px.settle()


async def test_a_break_after_the_last_token_ends_the_answer_here() -> None:
    first = stream(completion_event("a", [1], first=True, finish="length"), CUT)
    backend, px = two_decoders(first, stream(DONE))
    ex = await px.request(
        stream=True, extra={"prompt": PROMPT_IDS, "stream_options": {"include_usage": True}}
    ).done()
    objs = events(ex.body)
    assert b"error" not in ex.body and ex.body.endswith(DONE)
    assert objs[-1]["usage"] == {"prompt_tokens": 4, "completion_tokens": 1, "total_tokens": 5}
    assert len(backend.calls_of("decode")) == 1
    assert px.metric("pd_migrations_total", reason="broken", outcome="closed") == 1.0
    await px.settle()


async def test_replay_that_would_not_be_exact_ends_with_an_error_as_before() -> None:
    first = stream(completion_event("a", [1], first=True), CUT)
    backend, px = two_decoders(first, stream(DONE))
    ex = await px.request(stream=True, extra={"prompt": PROMPT_IDS, "stop": ["\n"]}).done()
    assert b"decode stream broke: connection reset by peer" in ex.chunks[-1]
    assert b"not continued elsewhere: stop strings" in ex.chunks[-1]
    assert text_of(events(ex.body)) == "a" and len(backend.calls_of("decode")) == 1
    assert "return_token_ids" not in backend.calls_of("decode")[0].json()
    assert px.metric("pd_migrations_total", reason="broken", outcome="refused") == 1.0
    assert px.requests("stream_error", 200) == 1
    await px.settle()


async def test_migration_stops_at_its_limit() -> None:
    first = stream(completion_event("a", [1], first=True), CUT)
    second = stream(completion_event("b", [2], first=True), CUT)
    backend, px = two_decoders(first, second)
    ex = await px.request(stream=True, extra={"prompt": PROMPT_IDS}).done()
    assert text_of(events(ex.body)) == "ab"
    assert b"decode stream broke" in ex.chunks[-1] and ex.body.endswith(DONE)
    assert px.metric("pd_migrations_total", reason="broken", outcome="continued") == 1.0
    assert px.metric("pd_migrations_total", reason="broken", outcome="limit") == 1.0
    assert [c.outcome for c in backend.calls_of("decode")] == [Outcome.CLOSED, Outcome.CLOSED]
    await px.settle()


async def test_migration_off_leaves_streams_untouched() -> None:
    first = stream(completion_event("a", [1], first=True), CUT)
    backend, px = two_decoders(first, stream(DONE), migration_limit=0)
    ex = await px.request(stream=True, extra={"prompt": PROMPT_IDS}).done()
    assert b"decode stream broke" in ex.chunks[-1]
    assert "return_token_ids" not in backend.calls_of("decode")[0].json()
    assert px.metric("pd_migrations_total", reason="broken", outcome="refused") == 1.0
    await px.settle()


def test_hide_ids_nulls_both_lists_and_nothing_else() -> None:
    raw = completion_event("a[1]", [1, 2], first=True)[6:-2]
    hidden = msgspec.json.decode(hide_ids(raw))
    (choice,) = hidden["choices"]
    assert choice["token_ids"] is None and choice["prompt_token_ids"] is None
    assert choice["text"] == "a[1]"


async def test_the_timeline_shows_the_move() -> None:
    """Decode-first with marks: the first transfer ends ``migrated`` (with the D it left),
    the continuation's transfer has its own first token and the request's end."""
    first = stream(completion_event("a", [1], first=True), CUT)
    rest = stream(completion_event("b", [2], first=True, finish="length"), DONE)
    backend = MockBackend({"prefill": PUSHED, "decode": [first, rest], "get": Reply.json(BINDING)})
    px = InMemoryProxy(backend, decode=[D_URL, D2_URL], binding_marks=True)
    ex = await px.request(stream=True, extra={"prompt": PROMPT_IDS}).done()
    assert text_of(events(ex.body)) == "ab"
    await px.settle()
    d0, d1 = backend.calls_of("decode")
    assert [(m.transfer_id, m.mark) for m in px.marks] == [
        (d0.transfer_id, MarkKind.FIRST_TOKEN),
        (d0.transfer_id, MarkKind.MIGRATED),
        (d1.transfer_id, MarkKind.FIRST_TOKEN),
        (d1.transfer_id, MarkKind.END),
    ]
    moved = px.marks[1].detail
    assert moved is not None and moved.outcome == d0.url
    assert [(e.transfer_id, e.outcome, e.message) for e in px.abandoned] == [
        (d0.transfer_id, "aborted", "migrated")
    ]


async def test_a_completions_logprobs_go_on_with_shifted_offsets() -> None:
    def with_lp(event: bytes, token: str, offset: int) -> bytes:
        obj = msgspec.json.decode(event[6:])
        obj["choices"][0]["logprobs"] = {
            "tokens": [token], "token_logprobs": [-0.1], "top_logprobs": [{token: -0.1}],
            "text_offset": [offset],
        }  # fmt: skip
        return b"data: " + msgspec.json.encode(obj) + b"\n\n"

    first = stream(
        with_lp(completion_event("ab", [1], first=True), "ab", 0),
        with_lp(completion_event("cd", [2]), "cd", 2),
        CUT,
    )
    rest = stream(with_lp(completion_event("ef", [3], first=True, finish="length"), "ef", 0), DONE)
    backend, px = two_decoders(first, rest)
    ex = await px.request(stream=True, extra={"prompt": PROMPT_IDS, "logprobs": 1}).done()
    objs = events(ex.body)
    assert text_of(objs) == "abcdef"
    offsets = [o for ob in objs for c in ob["choices"] for o in c["logprobs"]["text_offset"]]
    assert offsets == [0, 2, 4]
    assert backend.calls_of("decode")[1].json()["logprobs"] == 1
    await px.settle()


def test_take_records_as_note_and_hides_as_hide_ids() -> None:
    """``Tape.take`` (the relay's hook: one parse, then a short cut of the one list of ids
    when only that is left) records what ``Tape.note`` records and hides the ids as
    ``hide_ids`` does."""
    stream_events = [
        completion_event("The", [11], first=True),
        completion_event(' "quoted" "text":"', [12, 13]),
        completion_event("", [14]),
        completion_event("", []),
        completion_event("!", [15], finish="length"),
        chat_event(None, None),
        chat_event("", [16]),
        chat_event("ok", [17], finish="stop"),
    ]
    scanned, parsed = Tape(None), Tape(None)
    for ev in stream_events:
        payload = ev[6:-2]
        assert scanned.take(payload, hide=True) == hide_ids(payload)
        parsed.note(payload)
        fields = ("generated", "shown", "finish", "prompt_ids", "ids_seen")
        assert [getattr(scanned, f) for f in fields] == [getattr(parsed, f) for f in fields]


async def test_reasoning_output_is_not_continued() -> None:
    """A chat answer whose D splits reasoning from content: a completion continuation would
    not, so the break ends with an error event."""
    obj = msgspec.json.decode(chat_event("x", [5])[6:-2])
    obj["choices"][0]["delta"] = {"reasoning_content": "hmm"}
    reasoning = b"data: " + msgspec.json.encode(obj) + b"\n\n"
    first = stream(chat_event(None, None), reasoning, CUT)
    backend, px = two_decoders(first, stream(DONE))
    ex = await px.request(stream=True, chat=True).done()
    assert b"not continued elsewhere: reasoning or tool-call output" in ex.chunks[-1]
    assert len(backend.calls_of("decode")) == 1
    await px.settle()


async def test_the_broken_decoder_is_never_asked_again() -> None:
    """With no other D available the answer ends with an error event at once: the same D,
    frozen, would hold a continuation up to the first-token timeout."""
    first = stream(completion_event("a", [1], first=True), CUT)
    backend = MockBackend({"prefill": PUSHED, "decode": [first, stream(DONE)]})
    px = InMemoryProxy(backend, Flow.PREFILL_FIRST)  # one D
    ex = await px.request(stream=True, extra={"prompt": PROMPT_IDS}).done()
    assert b"not continued elsewhere: no other decode instance available" in ex.chunks[-1]
    assert len(backend.calls_of("decode")) == 1
    assert px.metric("pd_migrations_total", reason="broken", outcome="failed") == 1.0
    await px.settle()


async def test_a_break_after_the_usage_event_only_ends_the_stream() -> None:
    first = stream(completion_event("a", [1], first=True, finish="length"), usage_event(4, 1), CUT)
    _, px = two_decoders(first, stream(DONE))
    ex = await px.request(
        stream=True, extra={"prompt": PROMPT_IDS, "stream_options": {"include_usage": True}}
    ).done()
    usages = [o["usage"] for o in events(ex.body) if o.get("usage")]
    assert usages == [{"prompt_tokens": 4, "completion_tokens": 1, "total_tokens": 5}]
    assert ex.body.endswith(DONE) and b"error" not in ex.body
    await px.settle()


async def test_a_second_break_goes_to_a_third_decoder() -> None:
    first = stream(completion_event("a", [1], first=True), CUT)
    second = stream(completion_event("b", [2], first=True), CUT)
    third = stream(completion_event("c", [3], first=True, finish="length"), DONE)
    backend = MockBackend({"prefill": PUSHED, "decode": [first, second, third]})
    px = InMemoryProxy(
        backend, Flow.PREFILL_FIRST, decode=[D_URL, D2_URL, "http://d2:8202"], migration_limit=2
    )
    ex = await px.request(stream=True, extra={"prompt": PROMPT_IDS}).done()
    assert text_of(events(ex.body)) == "abc" and b"error" not in ex.body
    urls = [c.url for c in backend.calls_of("decode")]
    assert len(set(urls)) == 3, urls  # neither broken D was asked again
    assert backend.calls_of("decode")[2].json()["prompt"] == [*PROMPT_IDS, 1, 2]
    await px.settle()
