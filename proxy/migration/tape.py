"""What the client has been sent of one streamed answer, as token ids (``Tape``), and the ids
hidden again from a client that did not ask for them (``hide_ids``). Runs on the event loop, per
event of the answer."""

from __future__ import annotations

from typing import Any

import msgspec


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
