"""One contract, every backend: memory and Redis (one server, or Sentinel's master) must behave
alike, in the store (bindings, instances), the KV index and the load board the backend builds
beside it."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

import pytest

from metaserver.backend import Backend
from metaserver.errors import Conflict, Forbidden, NotFound, Unprocessable
from metaserver.kvindex.index import Change, Op, Placement
from metaserver.store import Store
from metaserver.store.records import (
    MAX_EVENTS,
    BindingPut,
    EventPut,
    InstancePut,
    OpenTransfers,
    PutOutcome,
    StoredBinding,
    event_json,
)
from pdwire.models import Binding, BindingState, Instance, KVEndpoint, LoadReport
from tests.metaserver.conftest import (
    SHORT_TTL_S,
    StoreTime,
    at,
    binding_spec,
    decode_instance,
)

S = BindingState
Clock = Callable[[], float]
# Records that must lapse live SHORT_TTL_S; a test waits LAPSE_S for them (``StoreTime.lapse``:
# at once on the memory store's fake clock, real time on Redis, whose TTLs are its own).
LAPSE_S = SHORT_TTL_S + 0.2


async def register(
    store: Store,
    instance_id: str = "decode-0",
    *,
    owner: str = "",
    cap: int = 0,
    clock: Clock = time.time,
    **over: Any,
) -> PutOutcome:
    spec = decode_instance(**(at(instance_id) | over))
    put = InstancePut.of(instance_id, spec, spec.ttl_s or 30.0, owner, cap)
    outcome, _ = await store.put_instance(put, clock())
    return outcome


async def bind(
    store: Store, tid: str = "t1", *, clock: Clock = time.time, **over: Any
) -> tuple[PutOutcome, Binding]:
    now = clock()
    outcome, rec = await store.put_binding(BindingPut.of(tid, binding_spec(**over), now), now)
    return outcome, Binding.model_validate_json(rec.to_json())


async def event(
    store: Store,
    tid: str,
    state: BindingState,
    actor: str = "p0",
    *,
    engine: bool = False,
    clock: Clock = time.time,
) -> Binding:
    """``state`` posted by ``actor``; ``engine``: as an engine credential posts it (its own
    steps only), else as an admin does."""
    now = clock()
    put = EventPut(tid, state, actor, event_json(state, actor, now, None), engine=engine)
    return Binding.model_validate_json((await store.add_event(put, now)).to_json())


async def test_store_put_binding_creates_then_same_content_is_idempotent(store: Store) -> None:
    await register(store)
    outcome, first = await bind(store)
    assert outcome is PutOutcome.CREATED
    assert first.state is S.BOUND and first.block_ids == [[4, 5, 6]]
    assert [e.state for e in first.events] == [S.BOUND]
    outcome, again = await bind(store)
    assert outcome is PutOutcome.SAME
    assert again == first


async def test_store_put_binding_with_different_content_conflicts(store: Store) -> None:
    await register(store)
    await bind(store)
    with pytest.raises(Conflict):
        await bind(store, block_ids=[[7, 8, 9]])
    rec = await store.get_binding("t1")
    assert rec is not None
    assert Binding.model_validate_json(rec.to_json()).block_ids == [[4, 5, 6]]


async def test_store_rejects_binding_to_unregistered_decode_instance(store: Store) -> None:
    with pytest.raises(Unprocessable, match="not registered"):
        await bind(store)
    assert await store.get_binding("t1") is None


async def test_store_rejects_binding_to_prefill_only_instance(store: Store) -> None:
    await register(store, role="prefill")
    with pytest.raises(Unprocessable, match="prefill-only"):
        await bind(store)


async def test_store_rejects_kv_endpoint_other_than_registered(store: Store) -> None:
    await register(store)
    with pytest.raises(Unprocessable, match="does not match"):
        await bind(store, kv_endpoint=KVEndpoint(host="6.6.6.6", port=5600))
    with pytest.raises(Unprocessable, match="does not match"):
        await bind(store, kv_endpoint=KVEndpoint(host="10.0.0.7", port=5601))


async def test_store_rejects_instance_without_kv_endpoint(store: Store) -> None:
    await register(store, kv_endpoint=None)
    with pytest.raises(Unprocessable, match="no kv_endpoint"):
        await bind(store)


async def test_store_events_move_forward_and_record_history(store: Store) -> None:
    await register(store)
    await bind(store)
    await event(store, "t1", S.PREFILL_STARTED)
    await event(store, "t1", S.PUSHING)
    await event(store, "t1", S.PUSHING)
    done = await event(store, "t1", S.DONE)
    assert done.state is S.DONE
    assert [e.state for e in done.events] == [
        S.BOUND,
        S.PREFILL_STARTED,
        S.PUSHING,
        S.PUSHING,
        S.DONE,
    ]
    assert done.events[-1].actor == "p0"
    assert done.updated_at >= done.created_at


async def test_store_events_may_skip_states(store: Store) -> None:
    await register(store)
    await bind(store)
    assert (await event(store, "t1", S.FAILED)).state is S.FAILED


@pytest.mark.parametrize(
    ("path", "bad"),
    [
        ([S.PUSHING], S.PREFILL_STARTED),
        ([S.DONE], S.FAILED),
        ([S.ABORTED], S.PUSHING),
        ([S.FAILED], S.DONE),
    ],
)
async def test_store_rejects_backward_or_post_terminal_events(
    store: Store, path: list[BindingState], bad: BindingState
) -> None:
    await register(store)
    await bind(store)
    for state in path:
        await event(store, "t1", state)
    with pytest.raises(Conflict):
        await event(store, "t1", bad)
    rec = await store.get_binding("t1")
    assert rec is not None and rec.state is path[-1]


async def test_store_duplicate_events_are_idempotent(store: Store) -> None:
    await register(store)
    await bind(store)
    await event(store, "t1", S.PREFILL_STARTED)
    again = await event(store, "t1", S.PREFILL_STARTED)
    await event(store, "t1", S.DONE)
    final = await event(store, "t1", S.DONE)
    assert [e.state for e in again.events] == [S.BOUND, S.PREFILL_STARTED]
    assert [e.state for e in final.events] == [S.BOUND, S.PREFILL_STARTED, S.DONE]


async def test_store_event_on_missing_binding_is_not_found(store: Store) -> None:
    with pytest.raises(NotFound):
        await event(store, "nope", S.DONE)


async def test_store_progress_events_are_bounded(store: Store) -> None:
    await register(store)
    await bind(store)
    for _ in range(MAX_EVENTS + 40):
        rec = await event(store, "t1", S.PUSHING)
    assert len(rec.events) == MAX_EVENTS
    final = await event(store, "t1", S.DONE)
    assert final.events[-1].state is S.DONE and len(final.events) == MAX_EVENTS + 1


async def test_store_list_filters_and_orders_newest_first(
    store: Store, store_time: StoreTime
) -> None:
    await register(store)
    await register(store, "decode-1")
    for i in range(5):
        d = "decode-0" if i % 2 else "decode-1"
        await bind(store, f"t{i}", clock=store_time, decode_instance_id=d)
        await store_time.lapse(0.002)
    await event(store, "t3", S.DONE, clock=store_time)
    everything = await store.list_bindings(state=None, instance_id=None, limit=100)
    assert [r.transfer_id for r in everything] == ["t4", "t3", "t2", "t1", "t0"]
    assert [
        r.transfer_id for r in await store.list_bindings(state=None, instance_id=None, limit=2)
    ] == ["t4", "t3"]
    done = await store.list_bindings(state=S.DONE, instance_id=None, limit=100)
    assert [r.transfer_id for r in done] == ["t3"]
    on_d1 = await store.list_bindings(state=None, instance_id="decode-1", limit=100)
    assert [r.transfer_id for r in on_d1] == ["t4", "t2", "t0"]


async def test_store_delete_binding(store: Store) -> None:
    await register(store)
    await bind(store)
    assert await store.delete_binding("t1") is True
    assert await store.get_binding("t1") is None
    assert await store.delete_binding("t1") is False


async def test_store_active_bindings_expire_after_ttl(
    store_factory: Callable[..., Any], store_time: StoreTime
) -> None:
    store: Store = await store_factory(binding_ttl_s=SHORT_TTL_S, retain_s=30.0)
    await register(store)
    await bind(store, "short")
    await bind(store, "kept")
    await event(store, "kept", S.DONE)  # terminal: retained for retain_s instead
    await store_time.lapse(LAPSE_S)
    assert await store.get_binding("short") is None
    kept = await store.get_binding("kept")
    assert kept is not None and kept.state is S.DONE
    listed = await store.list_bindings(state=None, instance_id=None, limit=10)
    assert [r.transfer_id for r in listed] == ["kept"]


async def test_store_terminal_bindings_expire_after_retain_window(
    store_factory: Callable[..., Any], store_time: StoreTime
) -> None:
    store: Store = await store_factory(binding_ttl_s=30.0, retain_s=SHORT_TTL_S)
    await register(store)
    await bind(store)
    await event(store, "t1", S.ABORTED)
    await store_time.lapse(LAPSE_S)
    assert await store.get_binding("t1") is None


async def test_store_instances_register_heartbeat_and_expire(
    store: Store, store_time: StoreTime
) -> None:
    t0 = store_time()
    await register(store, "d-a", ttl_s=SHORT_TTL_S, clock=store_time)
    await register(store, "p-a", role="prefill", ttl_s=30, clock=store_time)
    first = await store.get_instance("d-a")
    assert first is not None
    await store_time.lapse(SHORT_TTL_S / 2)
    # a heartbeat keeps it and its registration time
    await register(store, "d-a", ttl_s=SHORT_TTL_S, clock=store_time)
    beat = await store.get_instance("d-a")
    assert beat is not None
    assert beat.registered_at == first.registered_at >= t0
    assert beat.last_heartbeat > first.last_heartbeat
    assert [i.instance_id for i in await store.list_instances(None)] == ["d-a", "p-a"]
    assert [i.instance_id for i in await store.list_instances("prefill")] == ["p-a"]
    await store_time.lapse(0.6 * SHORT_TTL_S)  # past the first TTL, within the heartbeat's
    assert await store.get_instance("d-a") is not None
    await store_time.lapse(LAPSE_S)
    assert await store.get_instance("d-a") is None
    assert [i.instance_id for i in await store.list_instances(None)] == ["p-a"]
    with pytest.raises(Unprocessable):
        await bind(store, decode_instance_id="d-a")


async def test_store_delete_instance(store: Store) -> None:
    await register(store)
    assert await store.delete_instance("decode-0") is True
    assert await store.get_instance("decode-0") is None
    assert await store.delete_instance("decode-0") is False


async def test_store_drain_flag_survives_heartbeats_and_goes_with_the_registration(
    store: Store,
) -> None:
    await register(store, "d-a")
    await register(store, "d-b")
    assert await store.set_draining("ghost", True) is None
    assert await store.get_instance("ghost") is None  # no half record was made
    marked = await store.set_draining("d-a", True)
    assert marked is not None and marked.draining
    assert Instance.model_validate_json(marked.to_json()).draining is True
    await register(store, "d-a")  # a heartbeat keeps the drain
    beat = await store.get_instance("d-a")
    assert beat is not None and beat.draining
    listed = {i.instance_id: i.draining for i in await store.list_instances(None)}
    assert listed == {"d-a": True, "d-b": False}
    undrained = await store.set_draining("d-a", False)
    assert undrained is not None and not undrained.draining
    again = await store.get_instance("d-a")
    assert again is not None and not again.draining
    await store.set_draining("d-a", True)
    assert await store.delete_instance("d-a") is True
    await register(store, "d-a")  # registered again (a restart): not drained
    fresh = await store.get_instance("d-a")
    assert fresh is not None and not fresh.draining


async def test_store_drain_lapses_with_the_registration_ttl(
    store: Store, store_time: StoreTime
) -> None:
    await register(store, "d-a", ttl_s=SHORT_TTL_S)
    assert await store.set_draining("d-a", True) is not None
    await store_time.lapse(LAPSE_S)
    assert await store.set_draining("d-a", True) is None
    await register(store, "d-a", ttl_s=30)
    fresh = await store.get_instance("d-a")
    assert fresh is not None and not fresh.draining


async def test_store_a_lease_is_exclusive_and_each_step_is_its_owners(store: Store) -> None:
    await register(store)
    for p in ("p-a", "p-b"):
        await register(store, p, role="prefill")
    await bind(store)
    # a decode instance takes no lease, nor does an actor nobody registered
    for actor in ("decode-0", "ghost"):
        with pytest.raises(Forbidden, match="no lease"):
            await event(store, "t1", S.PREFILL_STARTED, actor, engine=True)
    # before the lease no prefill may move or end the transfer
    for state in (S.PUSHING, S.DONE, S.FAILED, S.ABORTED):
        with pytest.raises(Forbidden, match="not its step"):
            await event(store, "t1", state, "p-a", engine=True)
    taken = await event(store, "t1", S.PREFILL_STARTED, "p-a", engine=True)
    assert taken.state is S.PREFILL_STARTED
    again = await event(store, "t1", S.PREFILL_STARTED, "p-a", engine=True)  # its retry
    assert again.events == taken.events
    # the lease excludes a second prefill, whoever posts it
    for engine in (True, False):
        with pytest.raises(Conflict, match="p-a"):
            await event(store, "t1", S.PREFILL_STARTED, "p-b", engine=engine)
    with pytest.raises(Forbidden, match="not its step"):
        await event(store, "t1", S.PUSHING, "p-b", engine=True)
    with pytest.raises(Forbidden, match="not its step"):
        await event(store, "t1", S.ABORTED, "p-a", engine=True)  # the decode's to say
    assert (await event(store, "t1", S.PUSHING, "p-a", engine=True)).state is S.PUSHING
    assert (await event(store, "t1", S.DONE, "p-a", engine=True)).state is S.DONE
    held = await store.get_binding("t1")
    assert held is not None
    assert [e.actor for e in Binding.model_validate_json(held.to_json()).events] == [
        "decode-0",
        "p-a",
        "p-a",
        "p-a",
    ]
    # the decode ends its own transfers, taken or not; an admin may end any
    await bind(store, "t2")
    assert (await event(store, "t2", S.ABORTED, "decode-0", engine=True)).state is S.ABORTED
    await bind(store, "t3")
    await event(store, "t3", S.PREFILL_STARTED, "p-b", engine=True)
    assert (await event(store, "t3", S.FAILED, "decode-0", engine=True)).state is S.FAILED
    await bind(store, "t4")
    assert (await event(store, "t4", S.FAILED, "ops")).state is S.FAILED


async def test_store_keeps_each_url_and_kv_endpoint_to_one_live_instance(
    store: Store, store_time: StoreTime
) -> None:
    await register(store, "d-a")
    with pytest.raises(Conflict, match="d-a"):
        await register(store, "d-b", url=at("d-a")["url"])
    with pytest.raises(Conflict, match="d-a"):
        await register(store, "d-b", kv_endpoint=at("d-a")["kv_endpoint"])
    assert await store.get_instance("d-b") is None
    # the holder's own heartbeat is no collision; a move frees its old URL and endpoint at once
    assert await register(store, "d-a") is PutOutcome.SAME
    assert await register(store, "d-a", **at("d-c")) is PutOutcome.SAME
    assert await register(store, "d-b", **at("d-a")) is PutOutcome.CREATED
    # so do a deregistration and a lapse
    assert await store.delete_instance("d-b")
    assert await register(store, "d-e", **at("d-a")) is PutOutcome.CREATED
    await register(store, "d-f", ttl_s=SHORT_TTL_S)
    await store_time.lapse(LAPSE_S)
    assert await register(store, "d-g", **at("d-f")) is PutOutcome.CREATED


async def test_store_caps_the_instances_one_credential_holds(
    store: Store, store_time: StoreTime
) -> None:
    def pool(iid: str, **over: Any) -> Any:
        return register(store, iid, role="prefill", owner="pool", cap=3, **over)

    for i in range(3):
        assert await pool(f"p-{i}") is PutOutcome.CREATED
    with pytest.raises(Forbidden, match="pool"):
        await pool("p-3")
    assert await store.get_instance("p-3") is None
    assert await pool("p-0") is PutOutcome.SAME  # a heartbeat still counts
    assert await register(store, "q-0", role="prefill", owner="other", cap=3) is (
        PutOutcome.CREATED
    )
    assert await register(store, "r-0", role="prefill") is PutOutcome.CREATED  # no owner, no cap
    assert await store.delete_instance("p-1")  # a deregistration frees its place
    assert await pool("p-3") is PutOutcome.CREATED
    await pool("p-0", ttl_s=SHORT_TTL_S)
    await store_time.lapse(LAPSE_S)  # and so does a lapse
    assert await pool("p-4") is PutOutcome.CREATED


async def test_store_stats_count_states_and_done_latency(
    store: Store, store_time: StoreTime
) -> None:
    await register(store)
    for tid in ("a", "b", "c"):
        await bind(store, tid, clock=store_time)
    await store_time.lapse(0.03)
    await event(store, "a", S.DONE, clock=store_time)
    await event(store, "b", S.FAILED, clock=store_time)
    stats = await store.stats(scan_limit=100)
    assert stats.by_state == {"done": 1, "failed": 1, "bound": 1}
    assert stats.scanned == 3
    assert len(stats.done_latencies_s) == 1 and 0.02 <= stats.done_latencies_s[0] < 5
    assert stats.instances_by_role == {"decode": 1}


async def test_store_open_transfers_count_states_and_the_oldest(store: Store) -> None:
    assert await store.open_transfers(scan_limit=100) == OpenTransfers({}, None)
    await register(store)
    for tid in ("a", "b", "c", "d"):
        await bind(store, tid)
    first = await store.get_binding("a")
    assert first is not None
    await event(store, "a", S.DONE)
    await event(store, "b", S.PUSHING)
    got = await store.open_transfers(scan_limit=100)
    assert got.by_state == {"pushing": 1, "bound": 2}
    b = await store.get_binding("b")
    assert b is not None and got.oldest_created_at == b.created_at  # "a" is done: not counted
    newest = await store.open_transfers(scan_limit=1)  # only "d", the newest
    assert newest.by_state == {"bound": 1}


async def test_store_changes_wake_waiters_on_write(store: Store) -> None:
    await register(store)
    if hasattr(store, "subscribed"):
        await asyncio.wait_for(store.subscribed.wait(), 5)
    async with store.changes("t1") as sub:
        writer = asyncio.create_task(bind(store))
        assert await sub.wait(5.0) is True
        await writer
    async with store.changes("t1") as sub:
        assert await sub.wait(0.1) is False
        asyncio.get_running_loop().call_later(0.05, lambda: None)
        task = asyncio.create_task(event(store, "t1", S.DONE))
        assert await sub.wait(5.0) is True
        await task


async def test_store_watch_created_hands_over_each_new_binding_once(store: Store) -> None:
    await register(store)
    seen: list[StoredBinding | None] = []
    two = asyncio.Event()

    def listener(record: StoredBinding | None) -> None:
        seen.append(record)
        if len(seen) == 2:
            two.set()

    stop = store.watch_created(listener)
    await asyncio.wait_for(store.notifications_live(), 5)
    await bind(store, "w1")
    await event(store, "w1", S.DONE)  # a change, not a creation
    await bind(store, "w2")
    await asyncio.wait_for(two.wait(), 5)
    await asyncio.sleep(0.1)  # nothing more comes
    assert [r.transfer_id for r in seen if r is not None] == ["w1", "w2"]
    w2 = await store.get_binding("w2")
    assert w2 is not None and seen[1] is not None and seen[1].to_json() == w2.to_json()
    stop()
    await bind(store, "w3")
    await asyncio.sleep(0.1)
    assert len(seen) == 2


# ---- the KV index -------------------------------------------------------------------------


async def test_kv_index_matches_the_leading_keys_each_instance_holds(backend: Backend) -> None:
    index = backend.kv_index
    await index.apply("a", [Change(Op.STORE, [1, 2, 3, 4]), Change(Op.REMOVE, [3])])
    await index.apply("b", [Change(Op.STORE, [1, 2, 3])])
    # from the first key, up to the first one not held: a holds 1 2 (not 3), b 1 2 3, c nothing
    assert await index.match([1, 2, 3, 4], ["a", "b", "c"]) == {"a": 2, "b": 3, "c": 0}
    assert await index.match([2, 1], ["a"]) == {"a": 2}
    assert await index.match([9, 1], ["a"]) == {"a": 0}
    assert await index.match([], ["a", "b"]) == {"a": 0, "b": 0}
    assert await index.match([1], []) == {}
    assert await index.sizes() == {"a": 3, "b": 3}
    assert index.dropped == 0


async def test_kv_index_clear_and_drop_forget_an_instance(backend: Backend) -> None:
    index = backend.kv_index
    await index.apply("a", [Change(Op.STORE, [1, 2])])
    await index.apply("b", [Change(Op.STORE, [1, 2, 3])])
    await index.apply("b", [Change(Op.CLEAR), Change(Op.STORE, [9])])  # in order, one batch
    assert await index.match([9, 1], ["b"]) == {"b": 1}
    assert await index.match([1], ["b"]) == {"b": 0}
    await index.drop("a")
    assert await index.sizes() == {"b": 1}
    assert await index.match([1, 2], ["a"]) == {"a": 0}
    await index.drop("ghost")  # nothing there: nothing happens
    await index.touch("b")
    assert await index.sizes() == {"b": 1}


async def test_kv_index_placements_count_until_the_engine_clears(backend: Backend) -> None:
    index = backend.kv_index
    await index.apply("a", [Change(Op.STORE, [1, 2])])
    await index.place([Placement("a", [1, 2, 3, 4]), Placement("b", [1, 2]), Placement("c", [])])
    assert await index.match([1, 2, 3, 4, 5], ["a", "b", "c"]) == {"a": 4, "b": 2, "c": 0}
    assert await index.match([1, 2, 3, 4], ["a", "b"], placed=False) == {"a": 2, "b": 0}
    assert await index.sizes() == {"a": 2}  # the engines' blocks only
    await index.apply("a", [Change(Op.CLEAR)])  # a reset cache forgets what was placed too
    assert await index.match([1, 2, 3], ["a"]) == {"a": 0}
    await index.drop("b")
    assert await index.match([1], ["b"]) == {"b": 0}


async def test_kv_index_one_leader_renews_its_lease(backend: Backend) -> None:
    index = backend.kv_index
    assert await index.lead("me", 5.0)
    assert await index.lead("me", 5.0)  # renewed


# ---- the load board -------------------------------------------------------------------------


def _report(ttl_s: float = 30.0, **figures: Any) -> LoadReport:
    return LoadReport.model_validate({"ttl_s": ttl_s, **figures})


async def test_load_board_answers_the_others_summed(backend: Backend) -> None:
    board = backend.load_board
    a: dict[str, Any] = {"instances": {"http://p0": [2, 500]}, "open_circuits": ["http://p2"]}
    first = await board.report("a", _report(**a))
    assert first.others == {} and first.open_circuits == [] and first.recent == {}
    assert first.replicas == 1
    b: dict[str, Any] = {"instances": {"http://p0": [1, 100], "http://p1": [4, 40]}}
    b["recent"] = {"http://p0": 7}
    await board.report("b", _report(**b, open_circuits=["http://p2", "http://p1"]))
    c: dict[str, Any] = {
        "instances": {},
        "recent": {"http://p0": 3},
        "open_circuits": ["http://p3"],
    }
    view = await board.report("c", _report(**c))  # c's own figures are not counted for c
    assert view.others == {"http://p0": (3, 600), "http://p1": (4, 40)}
    assert view.open_circuits == ["http://p1", "http://p2"]  # each once, sorted
    assert view.recent == {"http://p0": 7}
    assert view.replicas == 3
    again = await board.report("a", _report(instances={"http://p0": [1, 1]}))  # replaces a's
    assert again.others == {"http://p0": (1, 100), "http://p1": (4, 40)}
    assert again.open_circuits == ["http://p1", "http://p2", "http://p3"]
    assert again.recent == {"http://p0": 10} and again.replicas == 3
    seen = await board.view("b")
    assert seen.others == {"http://p0": (1, 1)} and seen.open_circuits == ["http://p3"]


async def test_load_board_view_records_nothing(backend: Backend) -> None:
    board = backend.load_board
    await board.report("a", _report(instances={"http://p0": [2, 500]}))
    seen = await board.view("z")
    assert seen.others == {"http://p0": (2, 500)} and seen.replicas == 1
    assert (await board.view("a")).others == {}  # z left nothing to count
    assert (await board.report("b", _report(instances={}))).replicas == 2


async def test_load_board_reports_lapse_after_their_ttl(
    backend: Backend, store_time: StoreTime
) -> None:
    board = backend.load_board
    await board.report("a", _report(SHORT_TTL_S, instances={"http://p0": [2, 500]}))
    await board.report("b", _report(instances={"http://p0": [1, 100]}))
    assert (await board.view("c")).others == {"http://p0": (3, 600)}
    await store_time.lapse(LAPSE_S)
    view = await board.view("c")
    assert view.others == {"http://p0": (1, 100)} and view.replicas == 1
    assert (await board.report("a", _report(instances={}))).replicas == 2  # back, anew
