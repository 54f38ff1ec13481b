"""The kv policy in memory: each request's block keys matched against a real
``MemoryKVIndex`` (the metaserver's), P chosen by uncached load, D by hits within its slack,
fallbacks when the index cannot help. Tokens are characters here (a tokenizer double); the
real tokenizer and hashing are checked against vLLM in tests/pdwire and tests/e2e."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from typing import Any

import pytest

from metaserver.kvindex import Change, MemoryKVIndex, Op, Placement
from pdwire.block_hash import BlockHasher
from pdwire.models import KV_PLACED_MAX, KVEvents, MarkKind
from pdwire.models import Instance as Registered
from proxy.config import Flow
from proxy.instances import CircuitBreaker, Instance, Role
from proxy.kvroute.lookup import KVLookup, Placed, Unseen
from proxy.kvroute.tokens import token_ids_of
from proxy.policies.base import KVMatch, RequestInfo
from proxy.policies.kv import KVAware
from tests.proxy.inmemory import BINDING, D_URL, P_URL, PUSHED, InMemoryProxy
from tests.proxy.mock import MockBackend, Reply

P2_URL = "http://p1:8101"
D2_URL = "http://d1:8201"
BLOCK = 4
PROMPT = "The quick brown fox " * 8  # 160 characters: 40 blocks


class CharTokenizer:
    def encode(self, text: str, add_special_tokens: bool) -> list[int]:
        return [ord(c) for c in text]

    def render_chat(self, messages: list[dict[str, Any]]) -> str:
        return "".join(str(m.get("content") or "") for m in messages)


class IndexMatcher:
    """The metaserver's ``POST /v1/kv/match`` without HTTP: the same index class."""

    def __init__(self) -> None:
        self.index = MemoryKVIndex()
        self.calls = 0
        self.fail = False
        self.placed: list[str] = []
        self.batches: list[int] = []
        self.gate: asyncio.Event | None = None  # set: placements wait for it
        self.fail_placing = False

    async def kv_match(self, keys: Sequence[int], instance_ids: Sequence[str]) -> dict[str, int]:
        self.calls += 1
        if self.fail:
            raise ConnectionError("metaserver unreachable")
        return await self.index.match(keys, instance_ids)

    async def kv_placed(self, placed: Sequence[tuple[str, Sequence[int]]]) -> None:
        if self.gate is not None:
            await self.gate.wait()
        self.placed += [i for i, _ in placed]
        self.batches.append(len(placed))
        if self.fail_placing:
            raise ConnectionError("metaserver unreachable")
        await self.index.place([Placement(i, keys) for i, keys in placed])


def keys_of(text: str) -> list[int]:
    return BlockHasher(BLOCK).keys([ord(c) for c in text])


def registered(iid: str, role: str, url: str) -> Registered:
    now = time.time()
    return Registered(
        instance_id=iid, role=role, url=url, registered_at=now, last_heartbeat=now,
        expires_at=now + 30, kv_events=KVEvents(port=5557, block_size=BLOCK),
    )  # fmt: skip


def proxy(
    gate: asyncio.Event | None = None,
    flow: Flow = Flow.PREFILL_FIRST,
    matcher: IndexMatcher | None = None,
    **settings: Any,
) -> tuple[InMemoryProxy, IndexMatcher, MockBackend]:
    prefill = Reply.completion("x", kv_transfer_params={"k": 1})
    if flow is Flow.DECODE_FIRST:
        prefill = PUSHED
    backend = MockBackend(
        {
            "prefill": prefill if gate is None else prefill.after(gate),
            "decode": Reply.completion("hi"),
            "get": Reply.json(BINDING | {"decode_instance_id": "d1"}),
        }
    )
    px = InMemoryProxy(
        backend,
        flow,
        prefill=[P_URL, P2_URL],
        decode=[D_URL, D2_URL],
        prefill_policy="kv",
        decode_policy="kv",
        tokenizer="unused: a double is wired",
        **settings,
    )
    rt = px.runtime
    rt.registry.apply_registry(
        [
            registered("p0", "prefill", P_URL),
            registered("p1", "prefill", P2_URL),
            registered("d0", "decode", D_URL),
            registered("d1", "decode", D2_URL),
        ]
    )
    matcher = matcher or IndexMatcher()
    rt.kv = KVLookup(CharTokenizer(), matcher, "vllm-none-hash", rt.metrics.kv_lookups.labels)
    rt.wire(backend, px.event_client)
    return px, matcher, backend


async def placed(m: IndexMatcher, n: int) -> None:
    """Until ``n`` placements reached the index double (they are sent in the background)."""
    for _ in range(200):
        if len(m.placed) >= n:
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"{len(m.placed)} placements, not {n}")


def inst(px: InMemoryProxy, url: str) -> Instance:
    (found,) = [i for i in px.runtime.registry.instances() if i.url == url]
    return found


async def hold(m: IndexMatcher, iid: str, blocks: int) -> None:
    await m.index.apply(iid, [Change(Op.STORE, keys_of(PROMPT)[:blocks])])


def lookups(px: InMemoryProxy) -> dict[str, float]:
    return {
        s.labels["outcome"]: s.value
        for fam in px.runtime.metrics.kv_lookups.collect()
        for s in fam.samples
        if s.name.endswith("_total")
    }


def urls(backend: MockBackend, leg: str) -> list[str]:
    return [c.url for c in backend.calls_of(leg)]


async def test_prefill_with_the_prefix_wins_while_it_is_not_busier() -> None:
    px, m, backend = proxy()
    await hold(m, "p1", 30)  # p1 holds 30 of the 40 blocks
    await hold(m, "d1", 40)
    # the prompt costs p1 40 uncached tokens, p0 160, each counted twice: p1 wins while its
    # in-flight tokens stay below 2 x (160 - 40) = 240
    inst(px, P2_URL).acquire(239)
    assert (await px.send()).status == 200
    assert urls(backend, "prefill") == [P2_URL]
    assert urls(backend, "decode") == [D2_URL]  # both D idle: the one holding the prompt
    assert lookups(px) == {"matched": 1.0}
    inst(px, P2_URL).release(239)
    await px.settle()
    px, m, backend = proxy()
    await hold(m, "p1", 30)
    inst(px, P2_URL).acquire(241)
    assert (await px.send()).status == 200
    assert urls(backend, "prefill") == [P_URL]
    inst(px, P2_URL).release(241)
    await px.settle()


async def test_a_prompt_just_sent_counts_as_held_there_before_the_index_has_it() -> None:
    """Until the index has taken a placement (its call still out here), this replica counts it
    itself: a burst sharing a new prefix goes to one P. Then the index's placement is what
    counts (the metaserver's ``--kv-placed``: the one memory of where prompts went)."""
    px, m, backend = proxy()
    m.gate = asyncio.Event()  # placements wait: the index knows nothing yet
    inst(px, P_URL).acquire(1)  # by load p1 first
    assert (await px.send()).status == 200
    assert urls(backend, "prefill") == [P2_URL]
    inst(px, P_URL).release(1)
    inst(px, P2_URL).acquire(100)  # busier now, but it will hold all 40 blocks: 100 < 2 x 160
    for _ in range(2):
        assert (await px.send()).status == 200
    assert urls(backend, "prefill") == [P2_URL] * 3
    assert lookups(px) == {"no_match": 3.0}  # the index itself still knows nothing
    m.gate.set()
    await placed(m, 6)
    assert (await m.index.match(keys_of(PROMPT), ["p1"])) == {"p1": 40}
    assert (await px.send()).status == 200
    assert urls(backend, "prefill") == [P2_URL] * 4
    assert lookups(px) == {"no_match": 3.0, "matched": 1.0}
    inst(px, P2_URL).release(100)
    await px.settle()


async def test_a_placement_the_index_did_not_take_counts_no_more() -> None:
    """A placement call that failed is not counted here after it ended (the engines' events
    will say where the blocks are): the prompt's P is then merely busier."""
    px, m, backend = proxy()
    m.fail_placing = True
    inst(px, P_URL).acquire(1)  # by load p1 first
    assert (await px.send()).status == 200
    await placed(m, 2)
    inst(px, P_URL).release(1)
    inst(px, P2_URL).acquire(100)
    assert (await px.send()).status == 200
    assert urls(backend, "prefill") == [P2_URL, P_URL]
    inst(px, P2_URL).release(100)
    await px.settle()


def test_a_placement_taken_while_a_match_was_out_counts_for_that_match() -> None:
    """The index may have answered a match before it took a placement whose call ended while
    the match was out: for that request the placement counts here; for a match asked after
    the call ended it does not (the index shows it), and it is forgotten once every earlier
    request has chosen."""
    unseen = Unseen()
    unseen.add(first := Placed("p1", [1, 2, 3]))
    before = unseen.asking()  # a match asked while the placement is being sent
    assert unseen.held("p1", [1, 2, 9], before) == 2
    unseen.ended([first], taken=True)
    after = unseen.asking()
    assert unseen.held("p1", [1, 2, 3], before) == 3
    assert unseen.held("p1", [1, 2, 3], after) == 0
    assert unseen.held("p0", [1, 2, 3], before) == 0
    unseen.answered(before)
    unseen.answered(after)
    assert unseen.held("p1", [1, 2, 3], before) == 0  # forgotten


async def test_a_prompt_another_replica_just_sent_counts_as_held_there() -> None:
    """Two replicas, one index: the prompt replica a just sent to a P (and a D) counts as held
    there for replica b too, before any engine event (``POST /v1/kv/placed``). Its P still
    computing (160 tokens in flight, as the shared load says), b sends it there all the same:
    160 < 2 x 160 recomputed on the other P."""
    pa, m, backend_a = proxy()
    pb, _, backend_b = proxy(matcher=m)
    assert (await pa.send()).status == 200
    (first,) = urls(backend_a, "prefill")
    for _ in range(100):  # sent in the background
        if len(m.placed) == 2:
            break
        await asyncio.sleep(0.01)
    assert sorted(i[0] for i in m.placed) == ["d", "p"]
    inst(pb, first).remote_tokens = 160
    assert (await pb.send()).status == 200
    assert urls(backend_b, "prefill") == [first]
    assert lookups(pb) == {"matched": 1.0}
    await pa.settle()
    await pb.settle()


async def test_placements_go_in_batches_the_metaserver_takes() -> None:
    """Choices made while a placement call is out wait for the next call, at most
    ``KV_PLACED_MAX`` per call (the metaserver refuses more): none is lost."""
    m = IndexMatcher()
    lookup = KVLookup(CharTokenizer(), m, "vllm-none-hash")
    p0 = Instance(P_URL, Role.PREFILL, CircuitBreaker(3, 10, lambda: 0.0))
    for i in range(150):
        info = RequestInfo("", 8)
        info.kv = {P_URL: KVMatch(0, 2, 0, [i, i + 1000], BLOCK, "p0")}
        lookup.placed(p0, info)
    for _ in range(100):
        if len(m.placed) == 150:
            break
        await asyncio.sleep(0.01)
    assert len(m.placed) == 150 and max(m.batches) <= KV_PLACED_MAX, m.batches
    assert (await m.index.match([149, 1149], ["p0"])) == {"p0": 2}
    lookup.close()


async def test_a_burst_follows_the_first_choice_before_any_answer() -> None:
    """The choice is remembered as it is made: a request chosen while the first one's prefill
    is still running goes to the same P, its prefix counted as held there."""
    gate = asyncio.Event()
    px, m, backend = proxy(gate)
    first = px.request()
    await backend.called("prefill", waiting=True)
    second = px.request()  # p0 by load alone: 160 in flight on the first's P
    await backend.called("prefill", count=2, waiting=True)
    assert urls(backend, "prefill") == [urls(backend, "prefill")[0]] * 2
    gate.set()
    await first.done()
    await second.done()
    await px.settle()


async def test_other_replicas_load_counts() -> None:
    """``--share-load``: the other replicas' in-flight tokens on p1 count as its own."""
    px, m, backend = proxy()
    await hold(m, "p1", 30)
    inst(px, P2_URL).remote_tokens = 241
    assert (await px.send()).status == 200
    assert urls(backend, "prefill") == [P_URL]
    inst(px, P2_URL).remote_open = True  # another replica's circuit for p1 is open
    inst(px, P2_URL).remote_tokens = 0
    assert (await px.send()).status == 200
    assert urls(backend, "prefill")[-1] == P_URL
    await px.settle()


async def test_prefill_load_counts_uncached_tokens() -> None:
    gate = asyncio.Event()
    px, m, backend = proxy(gate)
    await hold(m, "p1", 30)
    ex = px.request()
    await backend.called("prefill", waiting=True)
    assert inst(px, P2_URL).tokens == 160 - 30 * BLOCK  # what it computes, not the prompt
    gate.set()
    await ex.done()
    assert inst(px, P2_URL).tokens == 0
    await px.settle()


async def test_decode_hits_count_only_within_the_slack() -> None:
    px, m, backend = proxy()
    await hold(m, "d1", 40)
    for _ in range(3):
        inst(px, D2_URL).acquire(0)  # d1 three streams busier than d0 (slack 2)
    assert (await px.send()).status == 200
    assert urls(backend, "decode") == [D_URL]
    for _ in range(3):
        inst(px, D2_URL).release(0)
    await px.settle()


@pytest.mark.parametrize("case", ["index_down", "tools", "cache_salt"])
async def test_fallbacks_route_by_load(case: str) -> None:
    """The index cannot help: P chosen by load (both idle: the first), not by the prefix."""
    px, m, backend = proxy()
    await hold(m, "p1", 40)
    inst(px, P2_URL).acquire(1)  # by load p0; by the index p1
    extra: dict[str, Any] = {}
    if case == "index_down":
        m.fail = True
    elif case == "tools":  # a template input the proxy does not render
        extra = {"tools": [{"type": "function", "function": {"name": "f"}}]}
    else:
        extra = {"cache_salt": "tenant-a"}  # part of the first block's hash
    ex = await px.request(chat=case == "tools", extra=extra).done()
    assert ex.status == 200
    expected = {"index_down": "failed", "tools": "unsupported", "cache_salt": "unsupported"}
    assert lookups(px) == {expected[case]: 1.0}
    assert m.calls == (1 if case == "index_down" else 0)
    assert urls(backend, "prefill") == [P_URL]
    inst(px, P2_URL).release(1)
    await px.settle()


@pytest.mark.parametrize(
    ("body", "chat", "expected"),
    [
        ({"prompt": "ab"}, False, [97, 98]),
        ({"prompt": [5, 6, 7]}, False, [5, 6, 7]),
        ({"prompt": ["ab", "cd"]}, False, None),  # several prompts
        ({"prompt": [[1], [2]]}, False, None),
        ({"messages": [{"role": "user", "content": "hi"}]}, True, [104, 105]),
        ({"messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]}, True, None),
        ({"messages": [{"role": "user", "content": "hi"}], "chat_template": "x"}, True, None),
    ],
)
def test_token_ids_of(body: dict[str, Any], chat: bool, expected: list[int] | None) -> None:
    assert token_ids_of(CharTokenizer(), body, chat) == expected


async def test_decode_holding_the_prompt_skips_prefill() -> None:
    px, m, backend = proxy(cached_skip_ratio=0.9)
    await hold(m, "d0", 40)
    await hold(m, "d1", 10)
    assert (await px.send()).status == 200
    assert urls(backend, "prefill") == []
    assert urls(backend, "decode") == [D_URL]
    await px.settle()


async def test_chat_is_hashed_as_rendered() -> None:
    px, m, backend = proxy()
    await hold(m, "p1", 40)  # CharTokenizer renders the one message as its content
    assert (await px.request(chat=True).done()).status == 200
    assert urls(backend, "prefill") == [P2_URL]
    await px.settle()


async def test_the_decision_reaches_the_binding() -> None:
    """With --binding-marks, the first_token mark says what each candidate held."""
    px, m, backend = proxy(flow=Flow.DECODE_FIRST, binding_marks=True)
    await hold(m, "p1", 30)
    await hold(m, "d1", 40)
    assert (await px.send()).status == 200
    await px.settle()
    first = next(mk for mk in px.marks if mk.mark is MarkKind.FIRST_TOKEN)
    assert first.detail is not None
    assert first.detail.kv_held == {"p0": 0, "p1": 30, "d0": 0, "d1": 40}


def _prefill_pool() -> list[Instance]:
    clk = lambda: 0.0  # noqa: E731
    return [Instance(u, Role.PREFILL, CircuitBreaker(3, 10, clk)) for u in (P_URL, P2_URL)]


def _info(tokens: int, held: dict[str, int], keys: list[int]) -> RequestInfo:
    """A prompt of ``tokens`` tokens whose first ``held[url]`` blocks each P holds."""
    info = RequestInfo("", tokens)
    of = tokens // BLOCK
    info.kv = {
        url: KVMatch(held.get(url, 0), of, held.get(url, 0) * BLOCK, keys, BLOCK)
        for url in (P_URL, P2_URL)
    }
    return info


def test_idle_ties_go_to_the_prefill_that_computed_least_lately() -> None:
    """Every P idle and none holding the prompt: the P that computed least lately takes it,
    not the first candidate (which took every new prefix, and their later requests with
    them). The recent work decays: a minute later it weighs a third as much."""
    now = [1000.0]
    policy = KVAware(clock=lambda: now[0])
    ps = _prefill_pool()
    first = policy.choose(ps, _info(400, {}, [1, 2, 3]))
    second = policy.choose(ps, _info(400, {}, [4, 5, 6]))
    assert {first.url, second.url} == {P_URL, P2_URL}
    # a bigger one on the first P; the next new prompt goes to the second
    policy.choose(ps, _info(400, {first.url: 50}, [1, 2, 3]))  # held by the first: 200 more
    assert policy.choose(ps, _info(100, {}, [7, 8])).url == second.url
    # a prefix hit still wins over recent work
    held = _info(400, {first.url: 90}, [1, 2, 3])
    assert policy.choose(ps, held).url == first.url
    # load in flight comes before recent work
    second.acquire(1)
    assert policy.choose(ps, _info(100, {}, [9])).url == first.url
    second.release(1)
    now[0] += 600.0  # ten time constants: both forgotten, within a token
    assert first.work.at(now[0]) < 1.0


def test_ties_agree_whatever_the_candidate_order() -> None:
    """Two replicas list the Ps in different orders (as discovery found them) and see the same
    idle state: each new prompt goes to the same P on both, and new prompts spread over both."""
    chosen: list[str] = []
    for seed in range(20):
        keys = [seed * 100 + k for k in range(3)]
        picks = {
            KVAware().choose(order, _info(400, {}, keys)).url
            for order in (_prefill_pool(), _prefill_pool()[::-1])
        }
        assert len(picks) == 1, seed
        chosen += picks
    assert set(chosen) == {P_URL, P2_URL}
