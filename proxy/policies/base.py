"""The selection interface: pick one instance among the available ones for a request."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from proxy.instances import Instance


@dataclass(frozen=True, slots=True)
class KVMatch:
    """What one candidate's prefix cache holds of the prompt (``proxy.kvroute``)."""

    blocks: int  # leading blocks held
    of: int  # the prompt's full blocks
    tokens: int  # tokens those blocks cover
    keys: Sequence[int] = ()  # the prompt's block keys (shared by the instances of a scheme)
    block_size: int = 0
    instance_id: str = ""  # the candidate's registered id (the first_token mark names it)


class RequestInfo:
    """What policies may look at: prompt tokens (estimated, exact once tokenized), prefix block
    hashes of the text (lazy), and with KV-event routing each candidate's real cache hits."""

    __slots__ = ("_hashes", "kv", "kv_asked", "prompt", "tokens")

    BLOCK_CHARS = 256  # ≈ 64 tokens per hashed block

    def __init__(self, prompt: str, tokens: int) -> None:
        self.prompt = prompt
        self.tokens = tokens
        self._hashes: list[int] | None = None
        self.kv: dict[str, KVMatch] | None = None  # by instance url
        self.kv_asked = 0  # the number of the index match ``kv`` came from (``proxy.kvroute``)

    def uncached(self, inst: Instance) -> int:
        """The prompt tokens ``inst`` would compute (all of them when its cache is unknown)."""
        if self.kv is not None:
            m = self.kv.get(inst.url)
            if m is not None:
                return max(self.tokens - m.tokens, 0)
        return self.tokens

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
