"""Greedy generations through the official openai client, as token ids (+ logprobs)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from openai import AsyncOpenAI


@dataclass(frozen=True)
class Generation:
    text: str
    token_ids: tuple[int, ...]
    logprobs: tuple[float, ...]


# clients made during one test; the autouse fixture ``close_clients`` (conftest) closes them
_opened: list[AsyncOpenAI] = []


def client(
    base_url: str, *, timeout: float = 120.0, api_key: str = "unused", **kw: Any
) -> AsyncOpenAI:
    c = AsyncOpenAI(
        base_url=base_url + "/v1", api_key=api_key, max_retries=0, timeout=timeout, **kw
    )
    _opened.append(c)
    return c


async def close_all() -> None:
    """Close every client ``client`` made (their pooled connections), then forget them."""
    while _opened:
        await _opened.pop().close()


def _ids(tokens: list[str]) -> tuple[int, ...]:
    return tuple(int(t.removeprefix("token_id:")) for t in tokens)


async def complete(
    c: AsyncOpenAI,
    model: str,
    prompt: str | list[int],
    *,
    max_tokens: int = 16,
    stream: bool = False,
    headers: dict[str, str] | None = None,
    body: dict[str, Any] | None = None,
) -> Generation:
    """``body``: more fields of the request (vLLM's own, e.g. ``cache_salt``)."""
    args: dict[str, Any] = dict(
        model=model, prompt=prompt, max_tokens=max_tokens, temperature=0, logprobs=1,
        extra_body={"return_tokens_as_token_ids": True, **(body or {})}, extra_headers=headers,
    )  # fmt: skip
    if not stream:
        r = await c.completions.create(**args)
        choice = r.choices[0]
        assert choice.logprobs is not None and choice.logprobs.tokens is not None
        lps = tuple(float(x) for x in choice.logprobs.token_logprobs or [])
        return Generation(choice.text, _ids(choice.logprobs.tokens), lps)
    text, tokens, streamed = "", list[str](), list[float]()
    async for chunk in await c.completions.create(stream=True, **args):
        if not chunk.choices:
            continue
        ch = chunk.choices[0]
        text += ch.text
        if ch.logprobs and ch.logprobs.tokens:
            tokens += ch.logprobs.tokens
            streamed += [float(x) for x in ch.logprobs.token_logprobs or []]
    return Generation(text, _ids(tokens), tuple(streamed))


async def chat(
    c: AsyncOpenAI, model: str, content: str, *, max_tokens: int = 16, stream: bool = False
) -> Generation:
    args: dict[str, Any] = dict(
        model=model, messages=[{"role": "user", "content": content}], max_tokens=max_tokens,
        temperature=0, logprobs=True, extra_body={"return_tokens_as_token_ids": True},
    )  # fmt: skip
    if not stream:
        r = await c.chat.completions.create(**args)
        content_lp = r.choices[0].logprobs.content if r.choices[0].logprobs else None
        assert content_lp is not None
        return Generation(
            r.choices[0].message.content or "",
            _ids([t.token for t in content_lp]),
            tuple(t.logprob for t in content_lp),
        )
    text, tokens, lps = "", [], []
    async for chunk in await c.chat.completions.create(stream=True, **args):
        if not chunk.choices:
            continue
        ch = chunk.choices[0]
        text += ch.delta.content or ""
        if ch.logprobs and ch.logprobs.content:
            tokens += [t.token for t in ch.logprobs.content]
            lps += [t.logprob for t in ch.logprobs.content]
    return Generation(text, _ids(tokens), tuple(lps))


class Tokenizer:
    """The tiny model's tokenizer, to build prompts of exact token lengths."""

    def __init__(self, model_dir: Path) -> None:
        from tokenizers import Tokenizer as HFTokenizer

        self._tok = HFTokenizer.from_file(str(model_dir / "tokenizer.json"))
        self.vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]

    def count(self, text: str) -> int:
        return len(self._tok.encode(text).ids)
