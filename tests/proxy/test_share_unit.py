"""Active-active replicas (``proxy.instances.share``): three replicas' registries, each with
its own in-flight load, exchanging it through the metaserver's own ``MemoryLoadBoard``; a
replica that stops reporting stops counting, and one that cannot reach the metaserver falls
back to its own view."""

from __future__ import annotations

import asyncio

from metaserver.load import MemoryLoadBoard
from pdwire.models import LoadReport, LoadView
from proxy.instances import Instance, Registry, Role
from proxy.instances.share import WAIT_S, LoadShare
from proxy.policies import RequestInfo, make_policy
from proxy.policies.base import KVMatch
from proxy.policies.kv import KVAware
from tests.proxy.inmemory import BINDING, PUSHED, InMemoryProxy
from tests.proxy.mock import MockBackend, Reply
from tests.support.clock import virtual_time

P = ["http://p0:1", "http://p1:1"]


class Board:
    """``AsyncMetaserverClient.share_load`` and ``view_load`` in memory, on the metaserver's
    own board."""

    def __init__(self) -> None:
        self.now = 1000.0
        self.board = MemoryLoadBoard(lambda: self.now)
        self.down = False

    async def share_load(self, replica: str, report: LoadReport) -> LoadView:
        if self.down:
            raise ConnectionError("metaserver unreachable")
        return await self.board.report(replica, report)

    async def view_load(self, replica: str) -> LoadView:
        if self.down:
            raise ConnectionError("metaserver unreachable")
        return await self.board.view(replica)


def replica(board: Board, name: str) -> tuple[Registry, LoadShare]:
    reg = Registry()
    reg.reconcile(Role.PREFILL, P)
    return reg, LoadShare(reg, board, name, 0.1, clock=lambda: board.now)


def by_url(reg: Registry) -> dict[str, Instance]:
    return {i.url: i for i in reg.instances()}


async def test_replicas_see_each_others_load_and_spread_like_one() -> None:
    board = Board()
    (ra, a), (rb, b), (rc, c) = (replica(board, n) for n in "abc")
    by_url(ra)[P[0]].acquire(500)
    by_url(rb)[P[0]].acquire(300)
    for share in (a, b, c, a, b, c):
        await share.once()
    p0 = by_url(rc)[P[0]]
    assert (p0.remote_inflight, p0.remote_tokens) == (2, 800)
    assert c.replicas == 3
    least = make_policy("least_load")
    assert least.choose(rc.available(Role.PREFILL), RequestInfo("", 10)).url == P[1]
    own = by_url(ra)[P[0]]
    assert (own.remote_inflight, own.load) == (1, (2, 800))
    board.now += 5  # a and b stop reporting: their reports lapse
    await c.once()
    assert by_url(rc)[P[0]].remote_inflight == 0


async def test_open_circuit_is_shared() -> None:
    board = Board()
    (ra, a), (rb, b) = replica(board, "a"), replica(board, "b")
    breaker = by_url(ra)[P[1]].circuit
    for _ in range(10):
        breaker.record(False)
    await a.once()
    await b.once()
    assert [i.url for i in rb.available(Role.PREFILL)] == [P[0]]


async def test_unreachable_metaserver_falls_back_to_own_view() -> None:
    board = Board()
    (ra, a), (rb, b) = replica(board, "a"), replica(board, "b")
    by_url(ra)[P[0]].acquire(100)
    await a.once()
    await b.once()
    assert by_url(rb)[P[0]].remote_inflight == 1
    board.down = True
    await b.once()  # within the staleness bound: the last view stands
    assert by_url(rb)[P[0]].remote_inflight == 1
    board.now += b.stale_s + 0.1
    await b.once()
    assert by_url(rb)[P[0]].remote_inflight == 0 and b.failures == 2


async def test_kv_ties_follow_every_replicas_recent_work() -> None:
    """New prompts on idle Ps: each replica's ``kv`` policy sends a tie to the P that computed
    least lately, counting the work the other replicas sent (shared like load). Without it
    both replicas' first choice is the same P."""
    board = Board()
    (ra, a), (rb, b) = replica(board, "a"), replica(board, "b")
    kv = [KVAware(clock=lambda: board.now) for _ in range(2)]
    picks = []
    for i in range(6):
        reg, share, policy = (ra, a, kv[0]) if i % 2 == 0 else (rb, b, kv[1])
        await share.once()
        picks.append(policy.choose(reg.available(Role.PREFILL), new_prompt(i)).url)
        await share.once()
    assert picks.count(P[0]) == picks.count(P[1]) == 3, picks
    # the shared count is the other replica's, as it decays
    board.now += 60.0
    await a.once()
    await b.once()
    p0 = by_url(rb)[P[0]].work
    assert p0.remote == int(by_url(ra)[P[0]].work.own(board.now))
    assert 0 < p0.at(board.now) < 3 * 400


def new_prompt(seed: int) -> RequestInfo:
    """400 tokens no P holds (100 blocks of 4)."""
    info = RequestInfo("", 400)
    keys = [seed * 1000 + k for k in range(100)]
    info.kv = {url: KVMatch(0, 100, 0, keys, 4) for url in P}
    return info


class Counting(Board):
    """The board, counting reports and reads. Like Redis: each takes effect when it arrives;
    its answer comes ``delay`` later (``write_delay`` for a report: the disk)."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0
        self.reads = 0
        self.delay = 0.0
        self.write_delay = 0.0

    async def share_load(self, replica: str, report: LoadReport) -> LoadView:
        self.calls += 1
        view = await super().share_load(replica, report)
        await asyncio.sleep(self.write_delay)
        return view

    async def view_load(self, replica: str) -> LoadView:
        self.reads += 1
        view = await super().view_load(replica)
        await asyncio.sleep(self.delay)
        return view


def live(board: Board, name: str) -> tuple[Registry, LoadShare]:
    """A replica running on its event loop's clock: the tests below run on a virtual-time loop
    (``tests.support.clock``), where its interval, ``WAIT_S`` and the board's round trips are
    exactly as long as they say, however the machine schedules the test."""
    reg = Registry()
    reg.reconcile(Role.PREFILL, P)
    return reg, LoadShare(reg, board, name, 0.1, clock=asyncio.get_running_loop().time)


@virtual_time
async def test_a_choice_sees_the_other_replicas_choice_made_just_before() -> None:
    """Replica a chooses; b chooses a few milliseconds later, long before either's next
    interval: a reported its choice at once and b read the board before choosing. Every
    choice reads (one read each, when none is in flight)."""
    board = Counting()
    board.delay = board.write_delay = 0.001  # a round trip
    (ra, a), (rb, b) = live(board, "a"), live(board, "b")
    runs = [asyncio.create_task(s.run()) for s in (a, b)]
    try:
        await asyncio.sleep(0.01)  # both reported once; the next is an interval away
        by_url(ra)[P[0]].acquire(700)
        a.changed()
        await asyncio.sleep(0.003)
        await b.fresh()
        assert by_url(rb)[P[0]].remote_tokens == 700
        assert board.reads == 1
        await b.fresh()
        assert board.reads == 2
    finally:
        for t in runs:
            t.cancel()
        await asyncio.gather(*runs, return_exceptions=True)


@virtual_time
async def test_a_choice_during_a_report_is_reported_right_after_it() -> None:
    """A report out (Redis waiting for its disk) holds the load as it was when sent: a choice
    made meanwhile goes in the next report, sent as soon as that one is answered, not an
    interval later."""
    board = Counting()
    (ra, a), (rb, b) = live(board, "a"), live(board, "b")
    run = asyncio.create_task(a.run())
    try:
        await asyncio.sleep(0.01)  # a reported once; the next is an interval away
        board.write_delay = 0.02
        by_url(ra)[P[0]].acquire(100)
        a.changed()
        await asyncio.sleep(0.005)  # that report is out
        by_url(ra)[P[0]].acquire(200)
        a.changed()
        await asyncio.sleep(0.05)  # it is answered, the next carries the second choice
        await b.look()
        assert by_url(rb)[P[0]].remote_tokens == 300
        assert board.calls == 3
    finally:
        run.cancel()
        await asyncio.gather(run, return_exceptions=True)


@virtual_time
async def test_a_report_answered_late_does_not_undo_a_newer_read() -> None:
    board = Counting()
    (ra, a), (rb, b) = live(board, "a"), live(board, "b")
    board.write_delay = 0.05
    slow = asyncio.create_task(a.once())  # on the board at once, answered 50 ms later
    await asyncio.sleep(0.01)
    by_url(rb)[P[1]].acquire(500)
    board.write_delay = 0.0
    await b.once()
    await a.look()
    assert by_url(ra)[P[1]].remote_tokens == 500
    await slow  # its answer predates b's report
    assert by_url(ra)[P[1]].remote_tokens == 500


@virtual_time
async def test_a_burst_of_choices_shares_reads() -> None:
    """Choices arriving together wait for one read, not one each."""
    board = Counting()
    board.delay = 0.01
    _, a = live(board, "a")
    await a.once()
    await asyncio.gather(*(a.fresh() for _ in range(20)))
    assert board.reads == 1


@virtual_time
async def test_a_choice_waits_little_for_the_others() -> None:
    """A slow metaserver holds a choice at most WAIT_S; an unreachable one not at all."""
    board = Counting()
    _, a = live(board, "a")
    await a.once()
    board.delay = 1.0
    clock = asyncio.get_running_loop().time
    t0 = clock()
    await a.fresh()
    assert clock() - t0 < WAIT_S + 0.03
    await asyncio.sleep(1.0)  # the slow read ends
    board.delay = 0.0
    board.down = True
    await a.look()  # fails
    reads = board.reads
    t0 = clock()
    await a.fresh()
    assert board.reads == reads and clock() - t0 < 0.01


class Spy:
    """``LoadSync`` recording what the dispatcher told it, with P's and D's load then."""

    def __init__(self, px: InMemoryProxy) -> None:
        self.px = px
        self.seen: list[tuple[str, int, int]] = []

    async def fresh(self) -> None:
        self.seen.append(("fresh", self.px.p.inflight, self.px.d.inflight))

    def changed(self) -> None:
        self.seen.append(("changed", self.px.p.inflight, self.px.d.inflight))


async def test_the_dispatcher_asks_before_choosing_and_tells_every_change() -> None:
    """Before the choice it reads; it reports the choice, P's release once D's first byte is
    in, and D's at the end of the answer, each as it happens (not an interval later: another
    replica would count the released load meanwhile)."""
    backend = MockBackend(
        {"prefill": PUSHED, "decode": Reply.completion("hi"), "get": Reply.json(BINDING)}
    )
    px = InMemoryProxy(backend)
    spy = Spy(px)
    px.runtime.share = spy
    px.runtime.wire(backend, px.event_client)
    assert (await px.send()).status == 200
    assert spy.seen == [("fresh", 0, 0), ("changed", 1, 1), ("changed", 0, 1), ("changed", 0, 0)]
    await px.settle()


@virtual_time
async def test_choices_against_an_unreachable_metaserver_do_not_spin() -> None:
    """While the metaserver is down the loop tries once per interval, however many choices."""
    board = Counting()
    board.down = True
    _, a = live(board, "a")
    run = asyncio.create_task(a.run())
    try:
        for _ in range(30):
            a.changed()
            await asyncio.sleep(0.01)
        assert board.calls <= 5, board.calls
    finally:
        run.cancel()
        await asyncio.gather(run, return_exceptions=True)
