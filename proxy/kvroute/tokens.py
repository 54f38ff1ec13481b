"""A request's prompt as token ids, the way vLLM's OpenAI server makes them.

Completions: a string is encoded with the tokenizer's special tokens (vLLM's default
``add_special_tokens=True``), token ids are taken as sent. Chat: the model's chat template renders
the messages with the generation prompt, and the text is encoded without adding special tokens
(the template wrote them). Anything else — several prompts, non-text content, tools, a
``chat_template`` of the client's, LoRA adapters — gives ``None``: the request is routed
without the index. ``tests/e2e/test_kv_routing.py`` compares with a real engine's ``/tokenize``.
"""

from __future__ import annotations

from typing import Any, Protocol

_CHAT_UNSUPPORTED = ("tools", "chat_template", "chat_template_kwargs", "documents")


class Tokenizer(Protocol):
    def encode(self, text: str, add_special_tokens: bool) -> list[int]: ...

    def render_chat(self, messages: list[dict[str, Any]]) -> str: ...


class HFTokenizer:
    """A Hugging Face tokenizer from a local directory (the model's own files)."""

    def __init__(self, path: str) -> None:
        from transformers import AutoTokenizer  # optional dependency: only with the kv policy

        self._tok = AutoTokenizer.from_pretrained(path)

    def encode(self, text: str, add_special_tokens: bool) -> list[int]:
        ids: list[int] = self._tok.encode(text, add_special_tokens=add_special_tokens)
        return ids

    def render_chat(self, messages: list[dict[str, Any]]) -> str:
        text = self._tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        assert isinstance(text, str)
        return text


def text_chars(body: dict[str, Any], chat: bool) -> int:
    """The characters a request would have tokenized (its prompt, or its messages' contents):
    what bounds the tokenizer's work before it starts."""
    if chat:
        messages = body.get("messages")
        if not isinstance(messages, list):
            return 0
        return sum(
            len(m["content"])
            for m in messages
            if isinstance(m, dict) and isinstance(m.get("content"), str)
        )
    prompt = body.get("prompt")
    return len(prompt) if isinstance(prompt, str) else 0


def token_ids_of(tok: Tokenizer, body: dict[str, Any], chat: bool) -> list[int] | None:
    if body.get("cache_salt") is not None:
        return None  # the salt enters the first block's hash: not computed here
    if chat:
        messages = body.get("messages")
        if not isinstance(messages, list) or any(k in body for k in _CHAT_UNSUPPORTED):
            return None
        for m in messages:
            if not isinstance(m, dict) or not isinstance(m.get("content"), str | None):
                return None
        return tok.encode(tok.render_chat(messages), add_special_tokens=False)
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        return tok.encode(prompt, add_special_tokens=True)
    if isinstance(prompt, list) and prompt and all(type(t) is int for t in prompt):
        return list(prompt)
    return None
