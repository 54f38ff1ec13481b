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
next call), so every proxy replica, this one included, counts it as held there until the
engines' events say so (the metaserver's ``--kv-placed``: the one memory of where prompts just
went). Until the index can have shown a placement to this replica's match — it is still being
sent, or it landed while the match was out — ``pending`` counts it here (``Unseen``); a
placement the metaserver did not take is not counted after its call ended.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections import deque
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
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


@dataclass(slots=True)
class Placed:
    """Where one prompt was sent: its block keys on one instance."""

    instance_id: str
    keys: Sequence[int]
    taken: int | None = None  # the matches asked when the index had taken it (None: not yet)


class Unseen:
    """Placements this replica's matches may not show yet: from ``placed`` until the index has
    taken them and every request whose match was asked before that has made its first choice
    (placement calls end in the order they were sent)."""

    def __init__(self) -> None:
        self._entries: deque[Placed] = deque()
        self.asked = 0  # matches asked so far (their numbers)
        self._out: set[int] = set()  # matches asked and not answered

    def add(self, placed: Placed) -> None:
        self._entries.append(placed)

    def ended(self, batch: Sequence[Placed], taken: bool) -> None:
        """A placement call ended: the index has ``batch`` (``taken``) or never will."""
        for placed in batch:
            placed.taken = self.asked
        if not taken:
            drop = {id(p) for p in batch}
            self._entries = deque(p for p in self._entries if id(p) not in drop)
        self._prune()

    def asking(self) -> int:
        self.asked += 1
        self._out.add(self.asked)
        return self.asked

    def answered(self, number: int) -> None:
        """The match numbered ``number`` failed, or its request made its first choice."""
        self._out.discard(number)
        self._prune()

    def _prune(self) -> None:
        oldest = min(self._out, default=self.asked + 1)
        entries = self._entries
        while entries and entries[0].taken is not None and entries[0].taken < oldest:
            entries.popleft()  # every match that could miss it has been answered
        while len(entries) > PLACED_QUEUE + KV_PLACED_MAX:
            entries.popleft()

    def held(self, instance_id: str, keys: Sequence[int], asked: int) -> int:
        """How many of ``keys``, from the first, were placed on ``instance_id`` out of sight
        of the match numbered ``asked``."""
        placed: set[int] = set()
        for p in self._entries:
            if p.instance_id == instance_id and (p.taken is None or p.taken >= asked):
                placed.update(p.keys)
        n = 0
        for key in keys:
            if key not in placed:
                break
            n += 1
        return n


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
        self._placed: list[Placed] = []  # to send
        self._placing: asyncio.Task[None] | None = None
        self.unseen = Unseen()

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
        asked = self.unseen.asking()
        try:
            for scheme, members in by_scheme.items():
                got = await self._matcher.kv_match(keys[scheme], [m.id for m in members])
                for m in members:
                    n = got.get(m.id, 0)
                    mine = keys[scheme]
                    bs = scheme.block_size
                    matched[m.url] = KVMatch(n, len(mine), n * bs, mine, bs, m.id)
        except BaseException as exc:
            self.unseen.answered(asked)
            if not isinstance(exc, Exception):
                raise
            log.debug("KV index not asked: %s", exc)
            self._count("failed")
            return
        info.kv = matched
        info.kv_asked = asked  # outstanding until the request's first choice (``pending``)
        self._count("matched" if any(m.blocks for m in matched.values()) else "no_match")

    def _finished(self, work: asyncio.Future[Any]) -> None:
        self._pending -= 1
        if not work.cancelled():
            work.exception()  # retrieved: a late failure after a timeout is nobody's

    def pending(self, info: RequestInfo) -> None:
        """Before a choice: count the placements the request's match could not show as held
        (a burst sharing a new prefix follows the first of its requests)."""
        if info.kv is None:
            return
        for url, m in info.kv.items():
            if not m.keys or not m.instance_id:
                continue
            n = self.unseen.held(m.instance_id, m.keys, info.kv_asked)
            if n > m.blocks:
                info.kv[url] = replace(m, blocks=n, tokens=n * m.block_size)
        self.unseen.answered(info.kv_asked)

    def placed(self, inst: Instance, info: RequestInfo) -> None:
        """The prompt goes to ``inst``: tell the index (in the background)."""
        m = None if info.kv is None else info.kv.get(inst.url)
        if m is None or not m.keys or not m.instance_id:
            return
        placed = Placed(m.instance_id, m.keys)
        self.unseen.add(placed)
        self._placed.append(placed)
        if len(self._placed) > PLACED_QUEUE:  # the oldest go unsent
            self.unseen.ended(self._placed[:-PLACED_QUEUE], taken=False)
            del self._placed[:-PLACED_QUEUE]
        if self._placing is None or self._placing.done():
            self._placing = asyncio.ensure_future(self._send_placed())

    async def _send_placed(self) -> None:
        while self._placed:
            n, keys = 0, 0
            while n < min(len(self._placed), KV_PLACED_MAX) and (
                n == 0 or keys < PLACED_BATCH_KEYS
            ):
                keys += len(self._placed[n].keys)
                n += 1
            batch, self._placed = self._placed[:n], self._placed[n:]
            try:
                await self._matcher.kv_placed([(p.instance_id, p.keys) for p in batch])
            except Exception as exc:  # the index learns them from the engines, later
                log.debug("placements not sent: %s", exc)
                self.unseen.ended(batch, taken=False)
            else:
                self.unseen.ended(batch, taken=True)

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
