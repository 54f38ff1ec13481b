"""The continuation of a broken answer (``continuation``: a ``/v1/completions`` request from the
ids the client has), its events fitted into the client's stream (``Splicer``), and the end of a
stream that had nothing left to generate (``closing_events``)."""

from __future__ import annotations

from typing import Any

from proxy.migration.tape import Tape
from proxy.rewrite import ClientRequest, decode, encode

COMPLETIONS = "/v1/completions"
# sampling fields a chat request passes on to its completion continuation
_CHAT_KEEP = (
    "model", "temperature", "top_p", "top_k", "min_p", "seed", "stop_token_ids", "ignore_eos",
    "repetition_penalty", "length_penalty", "skip_special_tokens",
    "spaces_between_special_tokens", "logit_bias", "allowed_token_ids", "bad_words", "user",
    "priority", "cache_salt", "vllm_xargs", "min_tokens", "include_stop_str_in_output",
)  # fmt: skip


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
