"""Per-pair KV integrity: P's first token against D's, before D's answer reaches the client.

On a greedy request (``temperature`` 0) P samples a first token in its prefill leg anyway, from
the prompt and its weights; D samples its first token from the KV that P pushed (D computes
only the prompt's last position itself). With the same weights and intact KV the two are the
same token. They are compared by id when both answers carry one (P's leg asks for
``return_token_ids``; D's answer has ids when the client asked for them or for logprobs as token
ids), else by text (the proxy has no tokenizer): P's answer against the start of D's first
content, read from D's first chunks, which are held until then. Text that is empty or an
incomplete UTF-8 piece (U+FFFD) is not judged, nor are requests where P and D sample under
different rules (``min_tokens``, which P's leg drops; ``echo``; ``best_of``).

A mismatch quarantines the pair for ``--pair-quarantine`` (the dispatcher pairs neither with
the other meanwhile), moves D to a new cache epoch (its prefix cache holds the wrong blocks),
is logged with both tokens, counted, marked on the binding, and the request is served by D
computing the prompt itself: the client never sees the suspect token.
"""

from __future__ import annotations

import enum
import logging
import time
from collections.abc import Callable
from typing import Any, NamedTuple

import msgspec

from proxy.instances import Instance
from proxy.metrics import Metrics

log = logging.getLogger("pdgate.proxy.integrity")

_decode = msgspec.json.Decoder()
_DONE = b"data: [DONE]"
MAX_READS = 16  # D's chunks read past the first while looking for its first content


class Verdict(enum.StrEnum):
    MATCH = "match"
    MISMATCH = "mismatch"
    UNJUDGED = "unjudged"  # no ids, and the texts cannot tell (empty, partial UTF-8, ...)


def judged(body: dict[str, Any]) -> bool:
    """Whether P's first token and D's must agree for this request: greedy, and sampled by the
    same rules on both legs."""
    t = body.get("temperature")
    if isinstance(t, bool) or not isinstance(t, (int, float)) or t != 0:
        return False
    if body.get("min_tokens") or body.get("min_completion_tokens") or body.get("echo"):
        return False
    best_of = body.get("best_of")
    return best_of is None or best_of == 1


class First(NamedTuple):
    """Choice 0's first token as an answer shows it: its text (all of choice 0's content seen
    so far, for D's stream) and, when the answer carries it, its id."""

    text: str | None
    token_id: int | None = None


def judge(p: First, d: First) -> Verdict:
    if p.token_id is not None and d.token_id is not None:
        return Verdict.MATCH if p.token_id == d.token_id else Verdict.MISMATCH
    p_text, d_text = p.text, d.text
    if not p_text or "\ufffd" in p_text or d_text is None:
        return Verdict.UNJUDGED
    if d_text.startswith(p_text):
        return Verdict.MATCH
    if p_text.startswith(d_text):  # D's content ended before P's token's text did
        return Verdict.UNJUDGED
    return Verdict.MISMATCH


def _token_id(c: dict[str, Any], chat: bool) -> int | None:
    """The first token id in a choice: ``token_ids`` (``return_token_ids``), else a logprobs
    token written as ``token_id:N`` (``return_tokens_as_token_ids``)."""
    ids = c.get("token_ids")
    if isinstance(ids, list) and ids and isinstance(ids[0], int):
        return int(ids[0])
    lp = c.get("logprobs")
    if not isinstance(lp, dict):
        return None
    if chat:
        content = lp.get("content")
        first = content[0] if isinstance(content, list) and content else None
        token = first.get("token") if isinstance(first, dict) else None
    else:
        tokens = lp.get("tokens")
        token = tokens[0] if isinstance(tokens, list) and tokens else None
    if isinstance(token, str) and token.startswith("token_id:") and token[9:].isdigit():
        return int(token[9:])
    return None


def _content(c: dict[str, Any], chat: bool, key: str) -> str | None:
    if chat:
        part = c.get(key)
        text = part.get("content") if isinstance(part, dict) else None
    else:
        text = c.get("text")
    return text if isinstance(text, str) else None


def first_of(choices: Any, chat: bool) -> First:
    """Choice 0's first token in a whole (not streamed) answer."""
    for c in choices if isinstance(choices, list) else ():
        if isinstance(c, dict) and c.get("index", 0) == 0:
            return First(_content(c, chat, "message"), _token_id(c, chat))
    return First(None)


class PrefillChoice(msgspec.Struct):
    """What the proxy reads of a choice in P's answer (the prompt's ids are skipped)."""

    index: Any = 0
    text: Any = None
    message: Any = None
    token_ids: Any = None


def prefill_first(choices: list[PrefillChoice] | None, chat: bool) -> First:
    """P's first token: its text, and its id (P's leg asks for ``return_token_ids``)."""
    for c in choices or ():
        if c.index == 0:
            return first_of(
                [{"text": c.text, "message": c.message, "token_ids": c.token_ids}], chat
            )
    return First(None)


def describe(p: First, d: First) -> str:
    def one(f: First) -> str:
        return f"{(f.text or '')[:20]!r}" + ("" if f.token_id is None else f" (id {f.token_id})")

    return f"P {one(p)}, D {one(d)}"


def answer_first(raw: bytes, chat: bool) -> First:
    try:
        obj = _decode.decode(raw)
    except msgspec.DecodeError:
        return First(None)
    return first_of(obj.get("choices"), chat) if isinstance(obj, dict) else First(None)


class StreamText:
    """Choice 0's content so far in D's SSE bytes, its first token's id when the chunks carry
    it, and whether that choice (or the stream) has ended."""

    __slots__ = ("ended", "text", "token_id")

    def __init__(self, raw: bytes, chat: bool) -> None:
        self.text = ""
        self.token_id: int | None = None
        self.ended = False
        for event in raw.split(b"\n\n"):
            event = event.strip()
            if event.startswith(_DONE):
                self.ended = True
                continue
            if not event.startswith(b"data: {"):
                continue
            try:
                obj = _decode.decode(event[6:])
            except msgspec.DecodeError:
                continue  # an event cut by the chunk boundary: complete after the next read
            choices = obj.get("choices") if isinstance(obj, dict) else None
            for c in choices if isinstance(choices, list) else ():
                if not isinstance(c, dict) or c.get("index", 0) != 0:
                    continue
                piece = _content(c, chat, "delta")
                if piece:
                    if self.token_id is None and not self.text:
                        self.token_id = _token_id(c, chat)
                    self.text += piece
                elif self.token_id is None and not self.text:
                    self.token_id = _token_id(c, chat)
                if c.get("finish_reason") is not None:
                    self.ended = True

    @property
    def first(self) -> First:
        return First(self.text or None, self.token_id)


async def stream_first(
    first: bytes,
    next_chunk: Callable[[], Any],
    chat: bool,
    p: First,
) -> tuple[bytes, First]:
    """Read D's stream until choice 0's first token can be compared with ``p`` (its id is in,
    or at least as much of its content as P's text, or the choice ended): the bytes read (to
    be relayed as they are) and what they show."""
    raw = first
    want = len(p.text or "")
    for _ in range(MAX_READS):
        seen = StreamText(raw, chat)
        has_id = seen.token_id is not None and p.token_id is not None
        if has_id or len(seen.text) >= want or seen.ended:
            return raw, seen.first
        chunk: bytes = await next_chunk()
        if not chunk:
            break
        raw += chunk
    return raw, StreamText(raw, chat).first


class PairGuard:
    """The pairs under quarantine, and the counts of what was judged."""

    def __init__(
        self, quarantine_s: float, metrics: Metrics, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.quarantine_s = quarantine_s
        self._clock = clock
        self._until: dict[tuple[str, str], float] = {}
        self._judged: dict[tuple[str, str], tuple[float, Verdict]] = {}  # the last, per pair
        self._verdicts = {v: metrics.first_token_checks.labels(v.value) for v in Verdict}
        self._mismatches = metrics.pair_mismatches
        metrics.quarantined = self.quarantined

    def blocked(self, p: Instance, d: Instance) -> bool:
        if not self._until:
            return False
        key = (p.url, d.url)
        until = self._until.get(key)
        if until is None:
            return False
        if self._clock() < until:
            return True
        del self._until[key]
        return False

    @property
    def now(self) -> float:
        return self._clock()

    def quarantined(self) -> list[tuple[str, str]]:
        now = self._clock()
        return [pair for pair, until in self._until.items() if now < until]

    def last_judged(self, p: Instance, d: Instance) -> tuple[float, Verdict] | None:
        """When the pair was last judged (a match or a mismatch), on this guard's clock."""
        return self._judged.get((p.url, d.url))

    def record(self, verdict: Verdict, p: Instance, d: Instance, tid: str, seen: str = "") -> None:
        self._verdicts[verdict].inc()
        if verdict is Verdict.UNJUDGED:
            return
        self._judged[(p.url, d.url)] = (self._clock(), verdict)
        if verdict is not Verdict.MISMATCH:
            return
        self._mismatches.labels(p.url, d.url).inc()
        self._until[(p.url, d.url)] = self._clock() + self.quarantine_s
        # D's prefix cache holds the blocks that came wrong: a new cache epoch (its requests'
        # cache_salt, ``ClientRequest.for_decode``) keeps every later request off them
        d.cache_epoch += 1
        log.error(
            "%s: first tokens differ (%s) between P %s and D %s: pair quarantined for %.0fs, "
            "D computes the prompt itself, D's cache epoch now %d",
            tid, seen, p.url, d.url, self.quarantine_s, d.cache_epoch,
        )  # fmt: skip
