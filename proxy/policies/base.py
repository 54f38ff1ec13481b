"""The selection interface: pick one instance among the available ones for a request."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from proxy.instances import Instance


class RequestInfo:
    """What policies may look at: estimated prompt tokens and prefix block hashes (lazy)."""

    __slots__ = ("_hashes", "prompt", "tokens")

    BLOCK_CHARS = 256  # ≈ 64 tokens per hashed block

    def __init__(self, prompt: str, tokens: int) -> None:
        self.prompt = prompt
        self.tokens = tokens
        self._hashes: list[int] | None = None

    @property
    def hashes(self) -> list[int]:
        """Chained hashes of the prompt's full 256-character blocks (approximate prefix)."""
        if self._hashes is None:
            out: list[int] = []
            h = 0
            text = self.prompt
            step = self.BLOCK_CHARS
            for start in range(0, len(text) - step + 1, step):
                h = hash((h, text[start : start + step]))
                out.append(h)
            self._hashes = out
        return self._hashes


class Policy(Protocol):
    name: str

    def choose(self, candidates: Sequence[Instance], req: RequestInfo) -> Instance:
        """``candidates`` is never empty."""
        ...

    def on_routed(self, inst: Instance, req: RequestInfo) -> None:
        """Called once the request was sent to ``inst`` (policies with memory learn here)."""
        ...
