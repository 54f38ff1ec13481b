"""Mid-stream migration: when D breaks after the client has part of a streamed answer (the
connection drops, D dies, or it sends nothing for ``--idle-timeout``), the same answer goes on
from another pair instead of ending with an error.

The proxy keeps what the client was sent as token ids (D's leg asks for ``return_token_ids``;
the ids are hidden again from a client that did not ask), and on a break sends a continuation:
a ``/v1/completions`` request whose prompt is the request's prompt token ids plus the tokens
generated so far, disaggregated again (P prefills all of it, D goes on), with ``max_tokens`` and
``min_tokens`` reduced by what was generated. Its events are spliced into the client's stream:
the first answer's ``id``, ``created`` and ``model``, a chat request's chunk shape, usage summed.
Greedy output is the same as an uninterrupted run's.

Replay is exact only when the continuation samples what the first D would have; the requests
where it cannot be (``refusal``) end with an error event as before, and are counted: several
choices, a chat request's logprobs, prompt logprobs, echo, stop strings (D holds back text that
may start one, so the client's text lags the ids), structured output and tools, presence and
frequency penalties (they count only generated tokens, and the replayed ones become prompt). A
completion's logprobs go on, their ``text_offset`` shifted past the text already sent. A seeded
request's sampler starts again from its seed after the splice. The ids replayed end where the
client's text does: tokens whose text D had not sent yet (an incomplete UTF-8 character) are
generated again, and the client gets only their text then (it has their ids and logprobs).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, NamedTuple

import msgspec

from proxy.rewrite import ClientRequest, decode, encode

if TYPE_CHECKING:
    from proxy.metrics import Metrics
    from proxy.sse import Broken, EventHook

COMPLETIONS = "/v1/completions"
# sampling fields a chat request passes on to its completion continuation
_CHAT_KEEP = (
    "model", "temperature", "top_p", "top_k", "min_p", "seed", "stop_token_ids", "ignore_eos",
    "repetition_penalty", "length_penalty", "skip_special_tokens",
    "spaces_between_special_tokens", "logit_bias", "allowed_token_ids", "bad_words", "user",
    "priority", "cache_salt", "vllm_xargs", "min_tokens", "include_stop_str_in_output",
)  # fmt: skip
_GUIDED = (
    "response_format", "structured_outputs", "guided_json", "guided_regex", "guided_choice",
    "guided_grammar", "guided_decoding_backend", "tools", "functions",
)  # fmt: skip


def refusal(req: ClientRequest) -> str | None:
    """Why this request's answer cannot be continued exactly on another pair (``None``: it
    can). Decided once, when the request is parsed."""
    body = req.body
    if not req.stream:
        return "not streamed (retried from the start before its first byte instead)"
    if (body.get("n") or 1) != 1 or (body.get("best_of") or 1) != 1:
        return "several choices"
    if body.get("prompt_logprobs") or (req.chat and body.get("logprobs")):
        return "chat logprobs or prompt logprobs"
    if body.get("echo"):
        return "echo"
    if body.get("stop"):
        return "stop strings"
    for key in _GUIDED:
        value = body.get(key)
        if value and not (key == "response_format" and _plain_text(value)):
            return "structured output or tools"
    if body.get("presence_penalty") or body.get("frequency_penalty"):
        return "presence or frequency penalty"
    opts = body.get("stream_options")
    if isinstance(opts, dict) and opts.get("continuous_usage_stats"):
        return "continuous usage stats"
    if not req.chat and not _single_prompt(body.get("prompt")):
        return "several prompts"
    return None


def _plain_text(fmt: Any) -> bool:
    return isinstance(fmt, dict) and fmt.get("type") == "text"


def _single_prompt(prompt: Any) -> bool:
    return isinstance(prompt, str) or (
        isinstance(prompt, list) and all(isinstance(t, int) for t in prompt)
    )


class _Delta(msgspec.Struct):
    content: str | None = None
    reasoning: str | None = None
    reasoning_content: str | None = None
    tool_calls: Any = None


class _Choice(msgspec.Struct):
    text: str | None = None
    delta: _Delta | None = None
    token_ids: list[int] | None = None
    prompt_token_ids: list[int] | None = None
    finish_reason: str | None = None


class _Chunk(msgspec.Struct):
    id: str | None = None
    created: int | None = None
    model: str | None = None
    choices: list[_Choice] = []
    prompt_token_ids: list[int] | None = None  # a chat answer's first chunk
    usage: Any = None


_chunk = msgspec.json.Decoder(_Chunk)
_IDS = b'"token_ids":['


class Tape:
    """What the client has been sent of one streamed answer, as token ids: the prompt's, those
    generated, and how many of them the client has the text of."""

    __slots__ = (
        "bad", "created", "finish", "generated", "id", "ids_seen", "migrations", "model",
        "prompt_ids", "resent", "shown", "text_len", "usage_sent",
    )  # fmt: skip

    def __init__(self, prompt_ids: list[int] | None) -> None:
        self.prompt_ids = prompt_ids
        self.bad: str | None = None  # what D sent that a continuation cannot reproduce
        self.generated: list[int] = []
        self.shown = 0  # generated tokens whose text has reached the client
        self.text_len = 0  # characters of text the client has
        self.resent = 0  # tokens the client has the ids of, not the text: generated again
        self.finish: str | None = None
        self.id: str | None = None  # the first answer's, kept across splices
        self.created: int | None = None
        self.model: str | None = None
        self.ids_seen = False  # D's answer carried token ids
        self.migrations = 0
        self.usage_sent = False  # the usage event reached the client

    def note(self, payload: bytes) -> _Chunk | None:
        """Record one event's JSON (``data: `` removed); returns it parsed (``None``: not a
        chunk, e.g. an error event)."""
        try:
            c = _chunk.decode(payload)
        except msgspec.DecodeError:
            return None
        if self.id is None:
            self.id, self.created, self.model = c.id, c.created, c.model
        if c.prompt_token_ids is not None and self.prompt_ids is None:
            self.prompt_ids = c.prompt_token_ids
        if c.usage is not None:
            self.usage_sent = True
        for ch in c.choices[:1]:
            if ch.prompt_token_ids is not None and self.prompt_ids is None:
                self.prompt_ids = ch.prompt_token_ids
            if ch.token_ids is not None:
                self.ids_seen = True
                self.generated.extend(ch.token_ids)
            delta = ch.delta
            if delta is not None and (
                delta.reasoning or delta.reasoning_content or delta.tool_calls
            ):
                self.bad = "reasoning or tool-call output (its split is not in the token ids)"
            text = ch.text if delta is None else delta.content
            if text:
                self.shown = len(self.generated)
                self.text_len += len(text)
            if ch.finish_reason is not None:
                self.finish = ch.finish_reason
                self.shown = len(self.generated)
        return c

    def take(self, payload: bytes, hide: bool) -> bytes:
        """``note`` the event, and return it with its ids hidden when ``hide``."""
        c = self.note(payload)
        if not hide or c is None:
            return payload
        if c.prompt_token_ids is not None or (c.choices and c.choices[0].prompt_token_ids):
            return hide_ids(payload)
        if not (c.choices and c.choices[0].token_ids is not None):
            return payload
        at = payload.find(_IDS)  # the only list of ids left in it
        end = payload.find(b"]", at)
        return payload[: at + 12] + b"null" + payload[end + 1 :]

    def rewind(self) -> None:
        """Forget the tokens after the last one whose text the client has: the continuation
        generates them again (``resent``), and the client gets only their text then."""
        self.resent = len(self.generated) - self.shown
        del self.generated[self.shown :]

    def unfit(self) -> str | None:
        """Why a break now cannot be continued (``None``: it can)."""
        if self.bad is not None:
            return self.bad
        if self.prompt_ids is None:
            return "D's answer carried no prompt token ids"
        if self.shown and not self.ids_seen:
            return "D's answer carried no token ids"
        return None


def continuation(req: ClientRequest, tape: Tape) -> ClientRequest | None:
    """The ``/v1/completions`` request that goes on from what the client has: prompt ids plus
    the generated ids it has the text of, the token budgets reduced by them (``None``: the
    client has every token it asked for)."""
    assert tape.prompt_ids is not None
    done = tape.shown
    src = req.body
    if req.chat:
        body = {k: src[k] for k in _CHAT_KEEP if k in src}
        limit = src.get("max_completion_tokens") or src.get("max_tokens")
    else:
        body = {k: v for k, v in src.items() if k not in ("prompt", "max_tokens")}
        limit = src.get("max_tokens")
    if isinstance(limit, int):
        if limit - done <= 0:
            return None
        body["max_tokens"] = limit - done
    body["prompt"] = [*tape.prompt_ids, *tape.generated[:done]]
    if isinstance(body.get("min_tokens"), int):
        body["min_tokens"] = max(0, body["min_tokens"] - done)
    body["stream"] = True
    body["return_token_ids"] = True
    if req.include_usage:
        body["stream_options"] = {"include_usage": True}
    else:
        body.pop("stream_options", None)
    cont = ClientRequest(body, chat=False)
    cont.track_ids = True
    return cont


class Splicer:
    """Turns a continuation's completion events into the client's stream: the first answer's
    ``id``/``created``/``model``, a chat request's chunk shape, token ids only if the client
    asked, usage counting every token the client got."""

    __slots__ = ("_base", "_chat", "_ids", "_offset", "_prompt_tokens", "_skip", "_tape")

    def __init__(self, req: ClientRequest, tape: Tape) -> None:
        self._chat = req.chat
        self._ids = bool(req.body.get("return_token_ids"))
        self._tape = tape
        self._base = tape.shown  # generated before this continuation
        self._offset = tape.text_len  # the continuation's text offsets start after it
        self._prompt_tokens = len(tape.prompt_ids or ())
        self._skip = tape.resent  # their ids (and logprobs) the client already has

    def event(self, payload: bytes) -> bytes | None:
        """One continuation event's JSON -> the client's event JSON (``None``: drop it)."""
        c = self._tape.note(payload)
        if c is None:
            return payload  # an error event: passed on as it is
        obj = decode(payload)
        if not isinstance(obj, dict):
            return payload
        head = {"id": self._tape.id, "created": self._tape.created, "model": self._tape.model}
        usage = obj.get("usage")
        if isinstance(usage, dict):
            completion = self._base + int(usage.get("completion_tokens") or 0)
            usage = {
                "prompt_tokens": self._prompt_tokens,
                "completion_tokens": completion,
                "total_tokens": self._prompt_tokens + completion,
            }
        choices = []
        for ch in obj.get("choices") or ():
            if self._skip:
                self._drop_resent(ch)
            ids = ch.get("token_ids") if self._ids else None
            if self._chat:
                choices.append({
                    "index": 0, "delta": {"content": ch.get("text") or ""}, "logprobs": None,
                    "finish_reason": ch.get("finish_reason"), "stop_reason": ch.get("stop_reason"),
                    "token_ids": ids,
                })  # fmt: skip
            else:
                lp = ch.get("logprobs")
                if isinstance(lp, dict) and isinstance(lp.get("text_offset"), list):
                    lp["text_offset"] = [self._offset + o for o in lp["text_offset"]]
                choices.append({**ch, "index": 0, "token_ids": ids, "prompt_token_ids": None})
        out: dict[str, Any] = {
            "id": head["id"],
            "object": "chat.completion.chunk" if self._chat else "text_completion",
            "created": head["created"],
            "model": head["model"],
            "choices": choices,
        }
        if usage is not None or "usage" in obj:
            out["usage"] = usage
        return encode(out)

    def _drop_resent(self, ch: dict[str, Any]) -> None:
        """Cut the ids and logprobs of tokens the client had before the splice (their text,
        which it did not have, stays)."""
        ids = ch.get("token_ids")
        if not isinstance(ids, list) or not ids:
            return
        k = min(self._skip, len(ids))
        self._skip -= k
        ch["token_ids"] = ids[k:]
        lp = ch.get("logprobs")
        if isinstance(lp, dict):
            for key in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
                if isinstance(lp.get(key), list):
                    lp[key] = lp[key][k:]


def closing_events(req: ClientRequest, tape: Tape) -> bytes:
    """The end of a stream whose D broke with nothing left to generate: a last chunk with the
    ``finish_reason`` when the client has none yet (``length``), the usage event when it
    asked for one and has none yet, then ``[DONE]``."""
    head = {
        "id": tape.id,
        "object": "chat.completion.chunk" if req.chat else "text_completion",
        "created": tape.created,
        "model": tape.model,
    }
    out = b""
    if tape.finish is None:
        tape.finish = "length"
        choice: dict[str, Any] = {"index": 0, "finish_reason": "length", "logprobs": None}
        if req.chat:
            choice["delta"] = {}
        else:
            choice["text"] = ""
        out += b"data: " + encode({**head, "choices": [choice]}) + b"\n\n"
    if req.include_usage and not tape.usage_sent:
        prompt = len(tape.prompt_ids or ())
        usage = {
            "prompt_tokens": prompt,
            "completion_tokens": tape.shown,
            "total_tokens": prompt + tape.shown,
        }
        out += b"data: " + encode({**head, "choices": [], "usage": usage}) + b"\n\n"
    return out + b"data: [DONE]\n\n"


def hide_ids(event: bytes) -> bytes:
    """``"token_ids": [...]`` and ``"prompt_token_ids": [...]`` as ``null``: what vLLM sends a
    client that did not ask for them."""
    for key in (b'"prompt_token_ids":[', b'"token_ids":['):
        start = 0
        while (at := event.find(key, start)) >= 0:
            open_at = at + len(key) - 1
            close_at = event.find(b"]", open_at)
            if close_at < 0:
                break
            event = event[:open_at] + b"null" + event[close_at + 1 :]
            start = open_at + 4
    return event


class Plan(NamedTuple):
    """What becomes of a broken stream: ``outcome`` (``pd_migrations_total``), and for
    ``continued`` the continuation to send, for ``closed`` the client's last events."""

    outcome: str
    request: ClientRequest | None = None
    closing: bytes = b""
    why: str = ""


class Migrator:
    """Carries streamed answers over D's breaks, at most ``limit`` times per request."""

    def __init__(self, limit: int, metrics: Metrics) -> None:
        self.limit = limit
        self._counts = metrics.migrations

    def tape(self, req: ClientRequest) -> Tape | None:
        """A tape for ``req`` when its answer could be continued (D's leg then asks for
        token ids); ``None`` when it could not (or migration is off)."""
        if self.limit <= 0 or not req.stream or refusal(req) is not None:
            return None
        req.track_ids = True
        prompt = req.body.get("prompt")
        ids = list(prompt) if not req.chat and isinstance(prompt, list) else None
        return Tape(ids)

    def hook(self, req: ClientRequest, tape: Tape) -> EventHook:
        """The first answer's events: recorded, their ids hidden unless the client asked."""
        take, hide = tape.take, not req.body.get("return_token_ids")

        def hook(payload: bytes) -> bytes:
            return take(payload, hide)

        return hook

    def plan(
        self, req: ClientRequest, tape: Tape | None, broken: Broken, elsewhere: bool = True
    ) -> Plan:
        """What to do now that ``broken`` happened; ``elsewhere``: a decode instance other than
        the broken one is available (the same one is never asked again: a frozen D would hold
        the continuation up to ``--first-token-timeout``)."""
        if tape is None:
            why = refusal(req) if self.limit > 0 else "migration is off"
            return self._count(broken, Plan("refused", why=why or "not tracked"))
        if tape.finish is not None:
            return self._count(broken, Plan("closed", closing=closing_events(req, tape)))
        unfit = tape.unfit()
        if unfit is not None:
            return self._count(broken, Plan("refused", why=unfit))
        if tape.migrations >= self.limit:
            return self._count(broken, Plan("limit", why=f"--migration-limit {self.limit}"))
        if not elsewhere:
            return self._count(broken, Plan("failed", why="no other decode instance available"))
        cont = continuation(req, tape)
        if cont is None:
            return self._count(broken, Plan("closed", closing=closing_events(req, tape)))
        tape.rewind()
        tape.migrations += 1
        return Plan("continued", request=cont)

    def counted(self, broken: Broken, outcome: str) -> None:
        self._counts.labels(broken.reason, outcome).inc()

    def _count(self, broken: Broken, plan: Plan) -> Plan:
        self.counted(broken, plan.outcome)
        return plan
