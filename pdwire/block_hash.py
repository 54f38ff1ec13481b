"""vLLM's prefix-cache block hashes, computed outside the engine.

A prompt's i-th full block of ``block_size`` token ids hashes to
``H((parent, tuple(tokens), extra_keys))`` with ``parent`` the previous block's hash, or for
the first block ``NONE_HASH = H(seed)``; the seed is ``PYTHONHASHSEED`` when the engine has it
set, else ``"vllm-none-hash"`` for the SHA-256 algorithms. ``H`` is SHA-256 over a pickle
(``sha256``, vLLM's default ``--prefix-caching-hash-algo``) or over canonical CBOR
(``sha256_cbor``). Derived from vLLM 0.32's ``vllm/v1/core/kv_cache_utils.py``
(``hash_block_tokens``, ``init_none_hash``, ``resolve_none_hash_seed``) and
``vllm/utils/hashing.py``. Only prompts without extra keys (no LoRA, multimodal input,
``cache_salt`` or prompt embeddings) hash this way; ``tests/pdwire/test_block_hash.py`` checks
equality with vLLM's own functions. The xxhash algorithms keep a secret per-process seed unless
``PYTHONHASHSEED`` is set, so they are supported only with an explicit seed.
"""

from __future__ import annotations

import hashlib
import pickle
from collections.abc import Callable, Sequence
from typing import Any

from pdwire.kv_events import block_key

DEFAULT_SEED = "vllm-none-hash"
ALGORITHMS = ("sha256", "sha256_cbor")


def _sha256_pickle(obj: Any) -> bytes:
    return hashlib.sha256(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)).digest()


def _sha256_cbor(obj: Any) -> bytes:
    import cbor2  # vLLM's own dependency; needed only for this algorithm

    return hashlib.sha256(cbor2.dumps(obj, canonical=True)).digest()


def hash_function(algo: str) -> Callable[[Any], bytes]:
    if algo == "sha256":
        return _sha256_pickle
    if algo == "sha256_cbor":
        return _sha256_cbor
    raise ValueError(f"prefix-caching hash algorithm {algo!r}: pdgate computes {ALGORITHMS}")


class BlockHasher:
    """Block hashes of token-id prompts, as one engine configuration computes them."""

    __slots__ = ("_fn", "_none", "block_size")

    def __init__(self, block_size: int, algo: str = "sha256", seed: str = DEFAULT_SEED) -> None:
        if block_size < 1:
            raise ValueError("block_size must be at least 1")
        self.block_size = block_size
        self._fn = hash_function(algo)
        self._none = self._fn(seed)

    def hashes(self, token_ids: Sequence[int], limit: int | None = None) -> list[bytes]:
        """The full blocks' hashes, first block first (at most ``limit`` of them)."""
        n = len(token_ids) // self.block_size
        if limit is not None:
            n = min(n, limit)
        out: list[bytes] = []
        parent = self._none
        size, fn = self.block_size, self._fn
        for i in range(n):
            parent = fn((parent, tuple(token_ids[i * size : (i + 1) * size]), None))
            out.append(parent)
        return out

    def keys(self, token_ids: Sequence[int], limit: int | None = None) -> list[int]:
        """``hashes`` as index keys (``pdwire.kv_events.block_key``)."""
        return [block_key(h) for h in self.hashes(token_ids, limit)]
