"""Once per request: its block keys, and how many of them each candidate's cache holds.

The keys are computed per hashing configuration the candidates registered (block size and
algorithm, ``InstanceSpec.kv_events``), with the seed the engines use (``--kv-hash-seed``:
their ``PYTHONHASHSEED``, vLLM's fixed default when unset). Tokenizing and hashing run in a few
worker threads (never on the event loop), bounded: a text over ``MAX_TEXT_CHARS``, more than
``MAX_PENDING`` tokenizations at once, or one past ``TOKENIZE_TIMEOUT_S`` route the request
without the index (counted as ``too_large``, ``busy``, ``timeout``). The match is one
``POST /v1/kv/match``. Any failure leaves the request unannotated: the policies then choose as
``least_load`` would.

Once the pair is chosen, ``placed`` tells the index where the prompt went (``POST
/v1/kv/placed``, in the background: sent at once, the choices made meanwhile batched into the
next call), so every proxy replica counts it as held there until the engines' events say so.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Protocol

from pdwire.block_hash import BlockHasher
from pdwire.models import KV_MATCH_MAX_KEYS, KV_PLACED_MAX
from proxy.instances import Instance
from proxy.kvroute.tokens import Tokenizer, text_chars, token_ids_of
from proxy.policies.base import KVMatch, RequestInfo

log = logging.getLogger("pdgate.proxy.kv")
MATCH_TIMEOUT_S = 0.5
THREADS = min(4, os.cpu_count() or 1)
# what one request may ask of the tokenizer: beyond it the request routes as least_load would
# (counted). The index matches at most KV_MATCH_MAX_KEYS blocks; a character is rarely under a
# quarter of a token, so a longer text holds nothing the index could match more of.
MAX_TEXT_CHARS = 4 * 16 * KV_MATCH_MAX_KEYS
TOKENIZE_TIMEOUT_S = 1.0  # the thread finishes on its own; the request does not wait for it
MAX_PENDING = 16  # tokenizations queued or running at once
PLACED_BATCH_KEYS = 16_384  # keys per POST /v1/kv/placed at most
PLACED_QUEUE = 1024  # placements waiting while the metaserver is slow (the oldest go first)


class Matcher(Protocol):
    """``pdwire.client.AsyncMetaserverClient`` (one without retries, ``MATCH_TIMEOUT_S``)."""

    async def kv_match(self, keys: Sequence[int], instances: Sequence[str]) -> dict[str, int]:
        """Per instance, the leading ``keys`` its cache holds; raises on any failure."""
        ...

    async def kv_placed(self, placed: Sequence[tuple[str, Sequence[int]]]) -> None:
        """Where prompts just went: ``(instance id, block keys)``; raises on any failure."""
        ...


@dataclass(frozen=True, slots=True)
class _Scheme:
    block_size: int
    algo: str


class KVLookup:
    def __init__(
        self,
        tokenizer: Tokenizer,
        matcher: Matcher,
        seed: str,
        counts: Any = None,
        *,
        timeout_s: float = TOKENIZE_TIMEOUT_S,
    ) -> None:
        self._tok = tokenizer
        self._timeout_s = timeout_s
        self._pending = 0  # tokenizations handed to the threads and not finished
        self._matcher = matcher
        self._seed = seed
        self._hashers: dict[_Scheme, BlockHasher] = {}
        # tokenizing is the cost (≈ 2.7 µs per token, tests/bench/kv_hash_bench.py) and the
        # tokenizer releases the GIL: a few threads keep requests from queueing behind one
        self._pool = ThreadPoolExecutor(THREADS, thread_name_prefix="pdgate-kv")
        self._counts = counts  # metrics: outcome -> counter (None in tests)
        self._placed: list[tuple[str, Sequence[int]]] = []
        self._placing: asyncio.Task[None] | None = None

    def _count(self, outcome: str) -> None:
        if self._counts is not None:
            self._counts(outcome).inc()

    async def annotate(
        self, info: RequestInfo, body: dict[str, Any], chat: bool, instances: Sequence[Instance]
    ) -> None:
        by_scheme: dict[_Scheme, list[Instance]] = {}
        for inst in instances:
            ev = inst.spec.kv_events if inst.spec is not None else None
            if ev is not None:
                by_scheme.setdefault(_Scheme(ev.block_size, ev.hash_algo), []).append(inst)
        if not by_scheme:
            self._count("no_index")
            return
        if text_chars(body, chat) > MAX_TEXT_CHARS:
            self._count("too_large")
            return
        if self._pending >= MAX_PENDING:
            self._count("busy")
            return
        work = asyncio.get_running_loop().run_in_executor(
            self._pool, self._keys, body, chat, list(by_scheme)
        )
        self._pending += 1
        work.add_done_callback(self._finished)
        try:
            keyed = await asyncio.wait_for(asyncio.shield(work), self._timeout_s)
        except TimeoutError:
            self._count("timeout")
            return
        except Exception as exc:  # a template or tokenizer error: route without the index
            log.debug("request not hashed: %s", exc)
            keyed = None
        if keyed is None:
            self._count("unsupported")
            return
        count, keys = keyed
        info.tokens = count  # exact now
        matched: dict[str, KVMatch] = {}
        try:
            for scheme, members in by_scheme.items():
                got = await self._matcher.kv_match(keys[scheme], [m.id for m in members])
                for m in members:
                    n = got.get(m.id, 0)
                    mine = keys[scheme]
                    bs = scheme.block_size
                    matched[m.url] = KVMatch(n, len(mine), n * bs, mine, bs, m.id)
        except Exception as exc:
            log.debug("KV index not asked: %s", exc)
            self._count("failed")
            return
        info.kv = matched
        self._count("matched" if any(m.blocks for m in matched.values()) else "no_match")

    def _finished(self, work: asyncio.Future[Any]) -> None:
        self._pending -= 1
        if not work.cancelled():
            work.exception()  # retrieved: a late failure after a timeout is nobody's

    def placed(self, inst: Instance, info: RequestInfo) -> None:
        """The prompt goes to ``inst``: tell the index (in the background)."""
        m = None if info.kv is None else info.kv.get(inst.url)
        if m is None or not m.keys or not m.instance_id:
            return
        self._placed.append((m.instance_id, m.keys))
        del self._placed[:-PLACED_QUEUE]
        if self._placing is None or self._placing.done():
            self._placing = asyncio.ensure_future(self._send_placed())

    async def _send_placed(self) -> None:
        while self._placed:
            n, keys = 0, 0
            while n < min(len(self._placed), KV_PLACED_MAX) and (
                n == 0 or keys < PLACED_BATCH_KEYS
            ):
                keys += len(self._placed[n][1])
                n += 1
            batch, self._placed = self._placed[:n], self._placed[n:]
            try:
                await self._matcher.kv_placed(batch)
            except Exception as exc:  # the index learns them from the engines, later
                log.debug("placements not sent: %s", exc)

    def _keys(
        self, body: dict[str, Any], chat: bool, schemes: list[_Scheme]
    ) -> tuple[int, dict[_Scheme, list[int]]] | None:
        ids = token_ids_of(self._tok, body, chat)
        if ids is None:
            return None
        out: dict[_Scheme, list[int]] = {}
        for scheme in schemes:
            hasher = self._hashers.get(scheme)
            if hasher is None:
                hasher = self._hashers[scheme] = BlockHasher(
                    scheme.block_size, scheme.algo, self._seed
                )
            out[scheme] = hasher.keys(ids, limit=KV_MATCH_MAX_KEYS)
        return len(ids), out

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        if self._placing is not None:
            self._placing.cancel()
