"""Pre-rendered OpenAI answers of the fake vLLM (bodies cached per shape: no JSON per token)."""

from __future__ import annotations

import functools
import json
from typing import Any

MODEL = "fake-model"


def _logprobs(chat: bool, i: int) -> Any:
    token = f"tok{i} "
    if chat:
        entry = {"token": token, "logprob": -0.5, "bytes": list(token.encode()), "top_logprobs": []}
        return {"content": [entry]}
    return {"tokens": [token], "token_logprobs": [-0.5], "top_logprobs": [{token: -0.5}],
            "text_offset": [0]}  # fmt: skip


@functools.lru_cache(maxsize=256)
def stream_chunks(
    chat: bool, tokens: int, n: int, logprobs: bool, ids: bool = False
) -> tuple[bytes, ...]:
    """SSE events of one streamed answer, without the usage event and ``[DONE]``. ``ids``
    (``return_token_ids``): as vLLM 0.32, the prompt's ids on the first chunk (the choice's
    in a completion, the chunk's in chat) and each chunk's token ids; ``null`` without."""
    obj = "chat.completion.chunk" if chat else "text_completion"
    head = {"id": "cmpl-fake", "object": obj, "created": 1, "model": MODEL}
    events: list[bytes] = []
    prompt_ids = list(range(3, 19)) if ids else None
    if chat:
        for idx in range(n):
            choice = {"index": idx, "delta": {"role": "assistant", "content": ""},
                      "finish_reason": None, "logprobs": None}  # fmt: skip
            events.append(_event({**head, "choices": [choice], "prompt_token_ids": prompt_ids}))
    for i in range(tokens):
        finish = "length" if i == tokens - 1 else None
        for idx in range(n):
            lp = _logprobs(chat, i) if logprobs else None
            token_ids = [100 + i] if ids else None
            if chat:
                choice = {"index": idx, "delta": {"content": f"tok{i} "}, "finish_reason": finish,
                          "logprobs": lp, "token_ids": token_ids}  # fmt: skip
            else:
                first = prompt_ids if i == 0 else None
                choice = {"index": idx, "text": f"tok{i} ", "finish_reason": finish,
                          "logprobs": lp, "prompt_token_ids": first,
                          "token_ids": token_ids}  # fmt: skip
            events.append(_event({**head, "choices": [choice]}))
    return tuple(events)


def usage(prompt_tokens: int, completion_tokens: int, cached: int | None) -> dict[str, Any]:
    out: dict[str, Any] = {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }
    if cached is not None:
        out["prompt_tokens_details"] = {"cached_tokens": cached}
    return out


def usage_event(chat: bool, u: dict[str, Any]) -> bytes:
    obj = "chat.completion.chunk" if chat else "text_completion"
    return _event({"id": "cmpl-fake", "object": obj, "created": 1, "model": MODEL,
                   "choices": [], "usage": u})  # fmt: skip


DONE = b"data: [DONE]\n\n"


def full_body(
    chat: bool, tokens: int, n: int, logprobs: bool, u: dict[str, Any], extra: dict[str, Any]
) -> bytes:
    text = "".join(f"tok{i} " for i in range(tokens))
    choices = []
    for idx in range(n):
        lp: Any = None
        if logprobs:
            parts = [_logprobs(chat, i) for i in range(tokens)]
            if chat:
                lp = {"content": [p["content"][0] for p in parts]}
            else:
                lp = {k: [x for p in parts for x in p[k]] for k in parts[0]} if parts else None
        if chat:
            choices.append({"index": idx, "finish_reason": "length", "logprobs": lp,
                            "message": {"role": "assistant", "content": text}})  # fmt: skip
        else:
            choices.append({"index": idx, "text": text, "finish_reason": "length", "logprobs": lp})
    body = {
        "id": "cmpl-fake",
        "object": "chat.completion" if chat else "text_completion",
        "created": 1,
        "model": MODEL,
        "choices": choices,
        "usage": u,
        **extra,
    }
    return json.dumps(body).encode()


def _event(obj: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"


def error_body(message: str, status: int) -> bytes:
    return json.dumps(
        {"error": {"message": message, "type": "BadRequestError", "code": status}}
    ).encode()
