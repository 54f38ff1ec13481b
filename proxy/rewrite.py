"""Request hygiene: parse the client's body once, strip what it must not set, build each leg.

* client-supplied ``kv_transfer_params`` are always removed;
* the prefill leg gets ``max_tokens``/``max_completion_tokens`` = 1, ``stream=false``, ``n=1``,
  and loses ``min_tokens``, ``min_completion_tokens``, ``stream_options``, ``best_of``; a
  greedy request's also gets ``return_token_ids`` (the first-token check, ``proxy.integrity``);
* the prompt length is estimated without a tokenizer (≈ 4 characters per token).
"""

from __future__ import annotations

import hashlib
from typing import Any

import msgspec

from pdwire.ascend import MAX_BATCH
from proxy.errors import BadRequest

_decode = msgspec.json.Decoder()
_encode = msgspec.json.Encoder().encode
CHARS_PER_TOKEN = 4
_PREFILL_DROP = ("min_tokens", "min_completion_tokens", "stream_options", "best_of")


DEFAULT_MAX_CHOICES = 16  # 'n' / 'best_of' above it: 400 (``--max-choices``)


class ClientRequest:
    __slots__ = ("body", "chat", "include_usage", "prompt", "stream", "tokens", "track_ids")

    def __init__(
        self, body: dict[str, Any], chat: bool, max_choices: int = DEFAULT_MAX_CHOICES
    ) -> None:
        self.body = body
        self.chat = chat
        for key in ("n", "best_of"):  # each choice is a sequence D decodes (and holds KV for)
            value = body.get(key)
            if value is None:
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise BadRequest(f"'{key}' must be a positive integer")
            if value > max_choices:
                raise BadRequest(f"'{key}' may be at most {max_choices}, not {value}")
        stream = body.get("stream", False)
        if not isinstance(stream, bool):
            raise BadRequest("'stream' must be a boolean")
        self.stream = stream
        opts = body.get("stream_options")
        if opts is not None and not isinstance(opts, dict):
            raise BadRequest("'stream_options' must be an object")
        self.include_usage = bool(stream and opts and opts.get("include_usage"))
        self.prompt, token_count = _prompt_of(body, chat)
        self.tokens = (
            token_count if token_count is not None else len(self.prompt) // CHARS_PER_TOKEN + 1
        )
        # D's leg asks for token ids (``return_token_ids``): its answer can be continued
        # elsewhere if D breaks mid-stream (``proxy.migration``)
        self.track_ids = False

    @classmethod
    def parse(cls, raw: bytes, chat: bool, max_choices: int = DEFAULT_MAX_CHOICES) -> ClientRequest:
        try:
            body = _decode.decode(raw)
        except msgspec.DecodeError as exc:
            raise BadRequest(f"request body is not valid JSON: {exc}") from None
        except RecursionError:  # msgspec's depth limit: a 400, not a 500 and a traceback
            raise BadRequest("request body is nested too deeply") from None
        if not isinstance(body, dict):
            raise BadRequest("request body must be a JSON object")
        # KV transfer parameters are the proxy's to set; vLLM also reads them from vllm_xargs
        body.pop("kv_transfer_params", None)
        xargs = body.get("vllm_xargs")
        if isinstance(xargs, dict):
            xargs.pop("kv_transfer_params", None)
        return cls(body, chat, max_choices)

    def for_decode(self, kv: dict[str, Any] | msgspec.Raw | None, cache_epoch: int = 0) -> bytes:
        """``cache_epoch`` > 0: D's prefix cache may hold wrong KV from before that epoch (a
        first-token mismatch, ``proxy.integrity``); the request's ``cache_salt`` is made the
        epoch's, so none of those blocks is reused."""
        body = self.body
        if cache_epoch:
            body = {**body, "cache_salt": epoch_salt(body.get("cache_salt"), cache_epoch)}
        if self.track_ids and not body.get("return_token_ids"):
            body = {**body, "return_token_ids": True}
        if kv is None:
            return _encode(body)
        return _encode({**body, "kv_transfer_params": kv})

    def for_prefill(self, kv: dict[str, Any], token_ids: bool = False) -> bytes:
        """``token_ids``: P's answer carries its token's id (``return_token_ids``)."""
        body = {k: v for k, v in self.body.items() if k not in _PREFILL_DROP}
        if token_ids:
            body["return_token_ids"] = True
        body["max_tokens"] = 1
        if "max_completion_tokens" in body:
            body["max_completion_tokens"] = 1
        body["stream"] = False
        if "n" in body:
            body["n"] = 1
        body["kv_transfer_params"] = kv
        return _encode(body)


def epoch_salt(client_salt: Any, epoch: int) -> str:
    """The ``cache_salt`` of ``epoch``: distinct per client salt (tenants stay apart), at most
    vLLM's 128 characters, none of its forbidden ones."""
    if isinstance(client_salt, str) and client_salt:
        digest = hashlib.sha256(f"{client_salt}\0{epoch}".encode()).hexdigest()[:32]
        return f"pdgate-{epoch}-{digest}"
    return f"pdgate-{epoch}"


def _prompt_of(body: dict[str, Any], chat: bool) -> tuple[str, int | None]:
    """The prompt as text (for prefix hashing) and, for token-id prompts, their count."""
    if chat:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise BadRequest("'messages' must be a non-empty array")
        parts: list[str] = []
        for m in messages:
            if not isinstance(m, dict):
                raise BadRequest("each message must be an object")
            content = m.get("content")
            if isinstance(content, str):
                parts.append(content)
            elif isinstance(content, list):
                parts.extend(str(p.get("text", "")) for p in content if isinstance(p, dict))
        return "\n".join(parts), None
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        return prompt, None
    if isinstance(prompt, list) and prompt:
        batch = isinstance(prompt[0], (str, list))
        if batch and len(prompt) > MAX_BATCH:  # each prompt is a binding, a task, a D request
            raise BadRequest(f"at most {MAX_BATCH} prompts per request, not {len(prompt)}")
        if all(isinstance(p, str) for p in prompt):
            return "\n".join(prompt), None
        if all(isinstance(p, int) for p in prompt):
            return " ".join(map(str, prompt[:4096])), len(prompt)
        if all(isinstance(p, list) for p in prompt):
            return "", sum(len(p) for p in prompt)
    raise BadRequest("'prompt' must be a string, an array of strings or of token ids")


def cached_tokens_of(usage: Any) -> int | None:
    if not isinstance(usage, dict):
        return None
    details = usage.get("prompt_tokens_details")
    if isinstance(details, dict) and isinstance(details.get("cached_tokens"), int):
        return int(details["cached_tokens"])
    return None


def merge_usage(usage: Any, prefill_cached: int | None) -> bool:
    """Report P's prefix-cache hits as the request's cached tokens (D's own count would include
    the KV it received). Returns whether ``usage`` changed."""
    if prefill_cached is None or not isinstance(usage, dict):
        return False
    details = usage.get("prompt_tokens_details")
    if not isinstance(details, dict):
        details = {}
        usage["prompt_tokens_details"] = details
    details["cached_tokens"] = prefill_cached
    return True


def encode(obj: Any) -> bytes:
    return _encode(obj)


def decode(raw: bytes) -> Any:
    return _decode.decode(raw)
