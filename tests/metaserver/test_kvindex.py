"""The KV-event index: vLLM's real ``ZmqEventPublisher`` feeding the follower, gaps replayed
or rebuilt, the manager following registered engines, both index stores, ``/v1/kv/match``."""

from __future__ import annotations

import asyncio
import secrets
import socket
import time
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

import pytest
import zmq.asyncio
from vllm.distributed import kv_events as vllm_events

import metaserver.app
from metaserver.app import create_app
from metaserver.backend import Backend, create_backend
from metaserver.cli import load_settings
from metaserver.kvindex import Change, KVIndex, Op, Placement
from metaserver.kvindex.follower import Follower, Source
from metaserver.kvindex.index import PLACED_S
from metaserver.kvindex.manager import KVEventManager
from metaserver.store.records import InstancePut
from pdwire.kv_events import block_key
from pdwire.models import InstanceSpec, KVEvents
from tests.metaserver.conftest import at, decode_instance

pytestmark = pytest.mark.timeout(60)


def _h(i: int) -> bytes:
    return i.to_bytes(32, "big")


def stored(*ids: int) -> vllm_events.BlockStored:
    return vllm_events.BlockStored(
        block_hashes=[_h(i) for i in ids], parent_block_hash=None, token_ids=[0] * 16 * len(ids),
        block_size=16, lora_id=None, medium="GPU", lora_name=None,
    )  # fmt: skip


def removed(*ids: int) -> vllm_events.BlockRemoved:
    return vllm_events.BlockRemoved(block_hashes=[_h(i) for i in ids], medium="GPU")


def batch(*events: Any) -> vllm_events.KVEventBatch:
    return vllm_events.KVEventBatch(ts=time.time(), events=list(events))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Engine:
    """vLLM's own publisher, as an engine with ``--kv-events-config`` runs it."""

    def __init__(self, *, replay: bool = True, buffer_steps: int = 10_000) -> None:
        port = free_port()
        self.pub = vllm_events.ZmqEventPublisher(
            0,
            endpoint=f"tcp://*:{port}",  # a wildcard binds (vLLM connects to a named host)
            replay_endpoint=f"tcp://127.0.0.1:{free_port()}" if replay else None,
            buffer_steps=buffer_steps,
            topic="kv",
        )
        replay_at = self.pub.get_publisher_config().replay_endpoint
        self.source = Source(f"tcp://127.0.0.1:{port}", replay_at, "kv")
        self.sent = 0

    def port(self, endpoint: str | None) -> int | None:
        return None if endpoint is None else int(endpoint.rsplit(":", 1)[1])

    def publish(self, *events: Any) -> None:
        self.pub.publish(batch(*events))
        self.sent += 1

    async def drained(self) -> None:
        """Until the publisher thread has sent everything queued."""
        for _ in range(200):
            if self.pub._event_queue.unfinished_tasks == 0:
                return
            await asyncio.sleep(0.01)
        raise AssertionError("publisher did not drain")


@pytest.fixture
def engines() -> Iterator[Callable[..., Engine]]:
    made: list[Engine] = []

    def make(**kw: Any) -> Engine:
        made.append(Engine(**kw))
        return made[-1]

    yield make
    for e in made:
        e.pub.shutdown()


@pytest.fixture
async def zctx() -> AsyncIterator[zmq.asyncio.Context]:
    ctx = zmq.asyncio.Context()
    yield ctx
    # a follower cancelled at the end of a test may not have closed its socket yet: term()
    # would block the loop that is to run its close
    ctx.destroy(linger=0)


async def until(check: Callable[[], Any], timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        if await check():
            return
        if time.monotonic() > deadline:
            raise AssertionError("condition not met in time")
        await asyncio.sleep(0.02)


def keys(*ids: int) -> list[int]:
    return [block_key(_h(i)) for i in ids]


async def held(index: KVIndex, iid: str, *ids: int) -> int:
    return (await index.match(keys(*ids), [iid]))[iid]


async def test_index_contract(backend: Backend) -> None:
    index = backend.kv_index
    await index.apply("a", [Change(Op.STORE, [1, 2, 3, 4]), Change(Op.REMOVE, [3])])
    await index.apply("b", [Change(Op.STORE, [1, 2, 3])])
    assert await index.match([1, 2, 3, 4], ["a", "b", "c"]) == {"a": 2, "b": 3, "c": 0}
    assert await index.match([], ["a"]) == {"a": 0}
    assert (await index.sizes())["a"] == 3
    await index.apply("b", [Change(Op.CLEAR), Change(Op.STORE, [9])])
    assert await index.match([9, 1], ["b"]) == {"b": 1}
    await index.drop("a")
    assert "a" not in await index.sizes()
    assert await index.match([1], ["a"]) == {"a": 0}
    assert await index.lead("me", 5.0)


async def test_placed_keys_count_until_they_lapse_or_the_engine_clears(backend: Backend) -> None:
    """A proxy's placement counts as held beside the engine's own blocks, for PLACED_S; a CLEAR
    or a drop forgets it."""
    index = backend.kv_index
    now = [1_000_000.0]
    index._clock = lambda: now[0]  # type: ignore[attr-defined]
    await index.apply("a", [Change(Op.STORE, [1, 2])])
    await index.place([Placement("a", [1, 2, 3, 4]), Placement("b", [1, 2])])
    assert await index.match([1, 2, 3, 4, 5], ["a", "b", "c"]) == {"a": 4, "b": 2, "c": 0}
    assert (await index.sizes())["a"] == 2  # the engine's blocks only
    assert await index.match([1, 2, 3, 4], ["a", "b"], placed=False) == {"a": 2, "b": 0}
    now[0] += PLACED_S - 1
    assert await index.match([1, 2, 3, 4], ["a", "b"]) == {"a": 4, "b": 2}
    now[0] += 2
    assert await index.match([1, 2, 3, 4], ["a", "b"]) == {"a": 2, "b": 0}
    await index.place([Placement("a", [1, 2, 3])])
    await index.apply("a", [Change(Op.CLEAR)])
    assert await index.match([1, 2, 3], ["a"]) == {"a": 0}
    await index.place([Placement("b", [7])])
    await index.drop("b")
    assert await index.match([7], ["b"]) == {"b": 0}


async def test_placements_last_the_kv_placed_setting(
    store_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``--kv-placed`` reaches the KV index the app builds, and a placement lapses after it."""
    built: list[Backend] = []

    def create(url: str, **kw: Any) -> Backend:
        built.append(create_backend(url, **kw))
        return built[-1]

    monkeypatch.setattr(metaserver.app, "create_backend", create)
    ns = f"placed-{secrets.token_hex(4)}"
    create_app(load_settings(["--store", store_url, "--namespace", ns, "--kv-placed", "2.5"]))
    (backend,) = built
    await backend.start()
    try:
        index = backend.kv_index
        now = [1_000_000.0]
        index._clock = lambda: now[0]  # type: ignore[attr-defined]
        await index.place([Placement("a", [1, 2])])
        now[0] += 2.0
        assert await index.match([1, 2], ["a"]) == {"a": 2}
        now[0] += 1.0
        assert await index.match([1, 2], ["a"]) == {"a": 0}
    finally:
        await backend.close()


async def test_index_bound(backend: Backend) -> None:
    index = backend.kv_index
    index._max = 3  # type: ignore[attr-defined]
    await index.apply("a", [Change(Op.STORE, [1, 2]), Change(Op.STORE, [3, 4, 5])])
    assert (await index.sizes())["a"] == 3
    assert index.dropped == 2
    assert await index.match([1, 2, 3, 4], ["a"]) == {"a": 3}


async def test_follower_applies_live_and_buffered_events(
    engines: Callable[..., Engine], backend: Backend, zctx: zmq.asyncio.Context
) -> None:
    engine = engines()
    engine.publish(stored(1, 2, 3))  # before the follower: it replays them at start
    await engine.drained()
    index = backend.kv_index
    f = Follower("e1", engine.source, index, zctx)
    task = asyncio.create_task(f.run())
    try:
        await until(lambda: _eq(held(index, "e1", 1, 2, 3), 3))
        engine.publish(stored(4), removed(2))
        await until(lambda: _eq(held(index, "e1", 1, 3, 4), 3))
        assert await held(index, "e1", 1, 2) == 1
        engine.publish(vllm_events.AllBlocksCleared(), stored(7))
        await until(lambda: _eq(held(index, "e1", 7), 1))
        assert await held(index, "e1", 1) == 0
        assert f.stats.batches == 3 and f.stats.rebuilds == 0 and f.stats.last_seq == 2
    finally:
        task.cancel()


async def _eq(value: Any, expected: Any) -> bool:
    return bool(await value == expected)


async def test_gap_is_replayed(
    engines: Callable[..., Engine], backend: Backend, zctx: zmq.asyncio.Context
) -> None:
    """A batch the SUB socket never delivered comes from the replay socket."""
    engine = engines()
    index = backend.kv_index
    f = Follower("e1", engine.source, index, zctx)
    task = asyncio.create_task(f.run())
    try:
        engine.publish(stored(1))
        await until(lambda: _eq(held(index, "e1", 1), 1))
        engine.publish(stored(2))  # seq 1: the follower "loses" it (applied below out of turn)
        engine.publish(stored(3), removed(1))  # seq 2
        await engine.drained()
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        f._next = 1  # as if seq 1 was lost in transit: seq 2 arrives first
        await f._on_batch(2, _payload(stored(3), removed(1)))
        assert f.stats.replays >= 2 and f.stats.rebuilds == 0
        assert await held(index, "e1", 2, 3) == 2  # seq 1 (block 2) came by replay
        assert await held(index, "e1", 1) == 0
    finally:
        task.cancel()


def _payload(*events: Any) -> bytes:
    import msgspec

    return msgspec.msgpack.encode(batch(*events))


async def test_lost_beyond_the_buffer_rebuilds_without_stale_blocks(
    engines: Callable[..., Engine], backend: Backend, zctx: zmq.asyncio.Context
) -> None:
    """The engine's buffer moved past the gap: entries are dropped and rebuilt from what
    replay holds, so a block evicted during the gap is not reported."""
    engine = engines(buffer_steps=2)
    index = backend.kv_index
    f = Follower("e1", engine.source, index, zctx)
    await f._rebuild(first=True)  # nothing buffered yet
    await f._on_batch(0, _payload(stored(1, 2)))
    engine.publish(stored(1, 2))  # seq 0 (already applied above)
    engine.publish(removed(2))  # seq 1: lost, and soon out of the buffer
    engine.publish(stored(5))  # seq 2
    engine.publish(stored(6))  # seq 3
    await engine.drained()
    await f._on_batch(3, _payload(stored(6)))
    assert f.stats.rebuilds == 1
    assert await held(index, "e1", 2) == 0  # evicted during the gap: not reported
    assert await held(index, "e1", 5, 6) == 2  # what the buffer still held
    assert await held(index, "e1", 1) == 0  # stored before the buffer: forgotten (safe side)


async def test_without_replay_a_gap_drops_the_entries(
    engines: Callable[..., Engine], backend: Backend, zctx: zmq.asyncio.Context
) -> None:
    engine = engines(replay=False)
    index = backend.kv_index
    f = Follower("e1", engine.source, index, zctx)
    await f._on_batch(0, _payload(stored(1)))
    await f._on_batch(2, _payload(stored(3)))
    assert f.stats.rebuilds == 1
    assert await held(index, "e1", 1) == 0 and await held(index, "e1", 3) == 1


async def test_restarted_engine_starts_over(backend: Backend, zctx: zmq.asyncio.Context) -> None:
    index = backend.kv_index
    f = Follower("e1", Source("tcp://127.0.0.1:1", None, ""), index, zctx)
    sent = [_payload(stored(seq + 1)) for seq in range(5)]
    for seq in range(5):
        await f._on_batch(seq, sent[seq])
    await f._on_batch(3, sent[3])  # a repeat (a replay overlapping the live stream): skipped
    assert f.stats.skipped == 1
    # a new engine process: its batch 2 (0 and 1 never reached the subscriber) is newer
    await f._on_batch(2, _payload(stored(8)))
    assert await held(index, "e1", 1) == 0 and await held(index, "e1", 8) == 1
    assert f.stats.last_seq == 2


async def test_bad_payload_is_counted_not_fatal(
    backend: Backend, zctx: zmq.asyncio.Context
) -> None:
    f = Follower("e1", Source("tcp://127.0.0.1:1", None, ""), backend.kv_index, zctx)
    await f._on_batch(0, b"\x00garbage")
    await f._on_batch(1, _payload(stored(1)))
    assert f.stats.bad == 1 and await held(backend.kv_index, "e1", 1) == 1


async def test_manager_follows_registered_engines(
    engines: Callable[..., Engine], backend: Backend
) -> None:
    engine = engines()
    spec = InstanceSpec(
        role="decode",
        url="http://127.0.0.1:9",
        kv_events=KVEvents(
            port=engine.port(engine.source.endpoint),
            replay_port=engine.port(engine.source.replay_endpoint),
            topic="kv",
            block_size=16,
        ),
    )
    plain = InstanceSpec(role="prefill", url="http://127.0.0.1:10")
    now = time.time()
    await backend.store.put_instance(InstancePut.of("d1", spec, 30), now)
    await backend.store.put_instance(InstancePut.of("p1", plain, 30), now)
    engine.publish(stored(1, 2))
    manager = KVEventManager(backend.store, backend.kv_index, interval_s=0.05)
    task = asyncio.create_task(manager.run())
    index = backend.kv_index
    try:
        await until(lambda: _eq(held(index, "d1", 1, 2), 2))
        assert [f.instance_id for f in manager.followers] == ["d1"] and manager.leading
        await backend.store.delete_instance("d1")
        await until(lambda: _eq(index.sizes(), {}))
        assert manager.followers == []
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


# replicas share a Redis; a memory store is one process, which always leads (test_index_contract)
@pytest.mark.parametrize("store_kind", ["redis", "sentinel"])
async def test_one_replica_follows(store_kind: str, backend_factory: Callable[..., Any]) -> None:
    a, b = await backend_factory(), await backend_factory()
    ia, ib = a.kv_index, b.kv_index
    ib._ns = ia._ns  # the same namespace on the same Redis: two replicas
    assert await ia.lead("a", 1.0) and not await ib.lead("b", 1.0)
    assert await ia.lead("a", 0.2)  # the leader renews
    await asyncio.sleep(0.3)  # its lease lapses: the other takes over
    assert await ib.lead("b", 1.0) and not await ia.lead("a", 1.0)


async def test_match_endpoint(api_factory: Callable[..., Any]) -> None:
    api = await api_factory()
    for iid in ("a", "b"):  # the index answers about instances with a KV-event stream only
        spec = decode_instance(**at(iid)).model_dump(mode="json")
        spec["kv_events"] = {"port": 5557, "block_size": 16}
        assert (await api.put(f"/v1/instances/{iid}", json=spec)).status_code == 201
    bad = await api.post("/v1/kv/match", json={"keys": [2**64], "instances": ["a"]})
    assert bad.status_code == 422
    assert (await api.post("/v1/kv/match", json={"keys": [1], "instances": []})).status_code == 422
    r = await api.post("/v1/kv/match", json={"keys": [1, 2], "instances": ["a", "b"]})
    assert r.status_code == 200 and r.json() == {"matched": {"a": 0, "b": 0}}
    placed = {"placed": [{"instance": "a", "keys": [1, 2]}, {"instance": "b", "keys": [1]}]}
    assert (await api.post("/v1/kv/placed", json=placed)).status_code == 204
    r = await api.post("/v1/kv/match", json={"keys": [1, 2], "instances": ["a", "b"]})
    assert r.json() == {"matched": {"a": 2, "b": 1}}
    events_only = {"keys": [1, 2], "instances": ["a", "b"], "placed": False}
    r = await api.post("/v1/kv/match", json=events_only)
    assert r.json() == {"matched": {"a": 0, "b": 0}}
    bad_bodies: list[dict[str, Any]] = [
        {"placed": []},
        {"placed": [{"instance": "a", "keys": []}]},
        {"placed": [{"instance": "bad id", "keys": [1]}]},
        {"placed": [{"instance": "a", "keys": [-1]}]},
    ]
    for body in bad_bodies:
        assert (await api.post("/v1/kv/placed", json=body)).status_code == 422, body
    state = (await api.get("/v1/kv")).json()
    assert state["following"] is False and state["blocks"] == {} and state["streams"] == {}
