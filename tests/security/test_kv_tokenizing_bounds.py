"""The ``kv`` policy tokenizes each prompt to find its cached blocks: one request may not hold the
routing of every other (security_review_2 N8). Before, a 16 MiB prompt was chat-templated and
tokenized whole (~2.7 us a token) in a 4-thread pool whose queue had no bound and whose waits had
no time limit: a few such requests stalled every kv-routed request. Now a text too long to match
more of, a full pool, or a tokenization past its time limit routes the request as least_load
would, counted in ``pd_kv_lookups_total{outcome}``."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

from proxy.instances import CircuitBreaker, Instance, Role
from proxy.kvroute.lookup import MAX_PENDING, MAX_TEXT_CHARS, KVLookup
from proxy.policies.base import RequestInfo
from tests.proxy.test_kv_routing_unit import IndexMatcher, registered


class GatedTokenizer:
    """Characters as tokens, each call held until ``gate`` opens (a slow or stuck template)."""

    def __init__(self) -> None:
        self.gate = threading.Event()
        self.calls = 0

    def encode(self, text: str, add_special_tokens: bool) -> list[int]:
        self.calls += 1
        self.gate.wait(30)
        return [ord(c) for c in text]

    def render_chat(self, messages: list[dict[str, Any]]) -> str:
        return "".join(str(m.get("content") or "") for m in messages)


class Counts:
    def __init__(self) -> None:
        self.seen: dict[str, int] = {}

    def __call__(self, outcome: str) -> Counts:
        self.seen[outcome] = self.seen.get(outcome, 0) + 1
        return self

    def inc(self) -> None:
        pass


@pytest.fixture
def tok() -> Iterator[GatedTokenizer]:
    t = GatedTokenizer()
    yield t
    t.gate.set()  # release the worker threads


def _candidate() -> Instance:
    inst = Instance("http://p0:8100", Role.PREFILL, CircuitBreaker(3, 10, time.monotonic))
    inst.spec = registered("p0", "prefill", "http://p0:8100")
    return inst


async def _annotate(lookup: KVLookup, body: dict[str, Any], chat: bool = False) -> RequestInfo:
    info = RequestInfo("", 8)
    await lookup.annotate(info, body, chat, [_candidate()])
    return info


async def test_a_text_too_long_to_match_is_not_tokenized(tok: GatedTokenizer) -> None:
    counts = Counts()
    lookup = KVLookup(tok, IndexMatcher(), "vllm-none-hash", counts)
    tok.gate.set()
    huge = "x" * (MAX_TEXT_CHARS + 1)
    for body, chat in (({"prompt": huge}, False),
                       ({"messages": [{"role": "user", "content": huge[:MAX_TEXT_CHARS // 2]}] * 3},
                        True)):  # fmt: skip
        info = await _annotate(lookup, body, chat)
        assert info.kv is None  # routed as least_load would
    assert tok.calls == 0 and counts.seen == {"too_large": 2}
    assert (await _annotate(lookup, {"prompt": "a short one"})).kv is not None  # the rest: as ever
    lookup.close()


async def test_a_stuck_tokenization_routes_by_load_after_its_time_limit(
    tok: GatedTokenizer,
) -> None:
    counts = Counts()
    lookup = KVLookup(tok, IndexMatcher(), "vllm-none-hash", counts, timeout_s=0.05)
    info = await asyncio.wait_for(_annotate(lookup, {"prompt": "held"}), 10)
    assert info.kv is None and counts.seen == {"timeout": 1}
    lookup.close()


async def test_a_full_pool_routes_the_next_requests_by_load_at_once(tok: GatedTokenizer) -> None:
    counts = Counts()
    lookup = KVLookup(tok, IndexMatcher(), "vllm-none-hash", counts, timeout_s=30)
    held = [
        asyncio.ensure_future(_annotate(lookup, {"prompt": f"p{i}"})) for i in range(MAX_PENDING)
    ]
    await asyncio.sleep(0.05)
    assert not any(h.done() for h in held)
    turned_away = await asyncio.wait_for(_annotate(lookup, {"prompt": "one more"}), 5)
    assert turned_away.kv is None and counts.seen == {"busy": 1}
    tok.gate.set()
    done = await asyncio.gather(*held)
    assert all(i.kv is not None for i in done) and counts.seen["no_match"] == MAX_PENDING
    assert (await _annotate(lookup, {"prompt": "again"})).kv is not None  # room again
    lookup.close()
