"""pdgate's block hashes equal vLLM's own (``get_request_block_hasher`` on a real ``Request``)
and its event reader parses what vLLM's own classes encode."""

from __future__ import annotations

import random

import msgspec
import pytest
from vllm import SamplingParams
from vllm.distributed import kv_events as vllm_events
from vllm.utils.hashing import sha256, sha256_cbor
from vllm.v1.core import kv_cache_utils
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.request import Request

from pdwire.block_hash import DEFAULT_SEED, BlockHasher
from pdwire.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    block_key,
    decode_batch,
)


def _vllm_hashes(tokens: list[int], block: int, fn: object) -> list[bytes]:
    req = Request(
        request_id="r",
        prompt_token_ids=tokens,
        sampling_params=SamplingParams(max_tokens=1),
        pooling_params=None,
        block_hasher=get_request_block_hasher(block, fn),  # type: ignore[arg-type]
    )
    return [bytes(h) for h in req.block_hashes]


@pytest.mark.parametrize(("algo", "fn"), [("sha256", sha256), ("sha256_cbor", sha256_cbor)])
@pytest.mark.parametrize("seed", [None, "1234"])
@pytest.mark.parametrize("block", [1, 16, 128])
def test_hashes_equal_vllms(
    monkeypatch: pytest.MonkeyPatch, algo: str, fn: object, seed: str | None, block: int
) -> None:
    if seed is None:
        monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    else:
        monkeypatch.setenv("PYTHONHASHSEED", seed)
    init_none_hash(fn)  # type: ignore[arg-type]
    try:
        rng = random.Random(block)
        for n in (0, block - 1, block, 5 * block + 3, 40 * block):
            tokens = [rng.randrange(200_000) for _ in range(n)]
            ours = BlockHasher(block, algo, seed or DEFAULT_SEED)
            theirs = _vllm_hashes(tokens, block, fn)
            assert ours.hashes(tokens) == theirs
            assert ours.keys(tokens) == [block_key(h) for h in theirs]
            assert ours.keys(tokens, limit=2) == [block_key(h) for h in theirs[:2]]
    finally:
        monkeypatch.delenv("PYTHONHASHSEED", raising=False)
        init_none_hash(sha256)
    assert kv_cache_utils.NONE_HASH == sha256(DEFAULT_SEED)


def test_other_seed_other_hashes() -> None:
    tokens = list(range(64))
    assert BlockHasher(16).keys(tokens) != BlockHasher(16, seed="x").keys(tokens)


def test_unknown_algorithm_is_refused() -> None:
    with pytest.raises(ValueError, match="xxhash"):
        BlockHasher(16, "xxhash")


def test_events_vllm_encodes_parse() -> None:
    h1, h2 = sha256("a"), sha256("b")
    batch = vllm_events.KVEventBatch(
        ts=12.5,
        events=[
            vllm_events.BlockStored(
                block_hashes=[h1, h2], parent_block_hash=None, token_ids=[1] * 32,
                block_size=16, lora_id=None, medium="GPU", lora_name=None,
                extra_keys=None, group_idx=0,
            ),
            vllm_events.BlockRemoved(block_hashes=[h1], medium="GPU"),
            vllm_events.AllBlocksCleared(),
            vllm_events.BlockStored(
                block_hashes=[int.from_bytes(h2, "big") & (2**64 - 1)], parent_block_hash=None,
                token_ids=[2] * 16, block_size=16, lora_id=None, medium=None, lora_name=None,
            ),
        ],
        data_parallel_rank=0,
    )  # fmt: skip
    got = decode_batch(msgspec.msgpack.encode(batch))
    assert got.ts == 12.5 and got.data_parallel_rank == 0
    stored, removed, cleared, as_int = got.events
    assert isinstance(stored, BlockStored) and stored.block_size == 16
    assert [block_key(h) for h in stored.block_hashes] == [block_key(h1), block_key(h2)]
    assert isinstance(removed, BlockRemoved) and removed.block_hashes == [h1]
    assert isinstance(cleared, AllBlocksCleared)
    assert isinstance(as_int, BlockStored) and block_key(as_int.block_hashes[0]) == block_key(h2)


def test_garbage_is_a_decode_error() -> None:
    with pytest.raises(msgspec.DecodeError):
        decode_batch(b"\x93\x01\x02")
