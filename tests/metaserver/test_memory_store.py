"""The memory store frees expired bindings without being asked for them, and without scanning
the live ones: each write drops what is due; an event's later expiry is honoured."""

from __future__ import annotations

import time

from metaserver.store.memory import MemoryStore
from metaserver.store.records import BindingPut, EventPut, InstancePut, event_json
from pdwire.models import BindingState
from tests.metaserver.conftest import binding_spec, decode_instance

S = BindingState


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


async def _store(clock: Clock) -> MemoryStore:
    store = MemoryStore(binding_ttl_s=10, retain_s=30, clock=clock)
    await store.put_instance(InstancePut.of("decode-0", decode_instance(), 1e6), 0.0)
    return store


async def _bind(store: MemoryStore, tid: str) -> None:
    await store.put_binding(BindingPut.of(tid, binding_spec(), time.time()), time.time())


async def _event(store: MemoryStore, tid: str, state: BindingState) -> None:
    put = EventPut(tid, state, "p0", event_json(state, "p0", time.time(), None))
    await store.add_event(put, time.time())


def _held(store: MemoryStore) -> set[str]:
    """What the store keeps in memory, expired or not (the sweep's business, not the API's)."""
    return set(store._bindings)


async def test_memory_store_write_drops_bindings_past_their_ttl() -> None:
    clock = Clock()
    store = await _store(clock)
    for i in range(600):
        await _bind(store, f"old-{i}")
    clock.now += 11
    await _bind(store, "new")
    assert _held(store) == {"new"}


async def test_memory_store_sweep_keeps_a_binding_an_event_extended() -> None:
    clock = Clock()
    store = await _store(clock)
    await _bind(store, "busy")
    await _bind(store, "idle")
    clock.now += 8
    await _event(store, "busy", S.PREFILL_STARTED)  # expires at +18 now
    clock.now += 3
    await _bind(store, "w1")
    assert _held(store) == {"busy", "w1"}
    clock.now += 8  # +19: past busy's new expiry
    await _bind(store, "w2")
    assert _held(store) == {"w1", "w2"}


async def test_memory_store_sweep_keeps_finished_bindings_for_the_retain_window() -> None:
    clock = Clock()
    store = await _store(clock)
    await _bind(store, "t")
    await _event(store, "t", S.DONE)  # terminal: kept 30 s, not 10
    clock.now += 20
    await _bind(store, "w1")
    assert "t" in _held(store)
    assert (await store.get_binding("t")) is not None
    clock.now += 11
    await _bind(store, "w2")
    assert _held(store) == {"w2"}


async def test_memory_store_sweep_spares_a_binding_recreated_under_the_same_id() -> None:
    clock = Clock()
    store = await _store(clock)
    await _bind(store, "t")
    assert await store.delete_binding("t")
    clock.now += 5
    await _bind(store, "t")  # the first one's heap entry is still due at +10
    clock.now += 6
    await _bind(store, "w")
    assert _held(store) == {"t", "w"}
    clock.now += 5  # +16: the second one is due now
    await _bind(store, "w2")
    assert _held(store) == {"w", "w2"}
