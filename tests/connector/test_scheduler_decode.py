"""Decode-side scheduler half, driven by vLLM's real Scheduler against a real metaserver."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.request import RequestStatus

from connector import stats
from connector.compat import features
from connector.metadata import PdgateMetadata
from pdwire.trace import format_traceparent
from tests.connector import harness as H
from tests.connector.slow_proxy import SlowProxy
from tests.support.clock import FakeClock
from tests.support.otlp import otlp_receiver
from tests.support.services import InThreadMetaserver

TOKEN = "t0ken"
AUTH = {"authorization": f"Bearer {TOKEN}"}


def _wait_binding(url: str, tid: str, timeout: float = 10.0) -> dict[str, Any]:
    r = httpx.get(
        f"{url}/v1/bindings/{tid}", params={"wait": timeout}, timeout=timeout + 5, headers=AUTH
    )
    assert r.status_code == 200, r.text
    body: dict[str, Any] = r.json()
    return body


def _recv_params(tid: str, url: str = "http://ignored") -> dict[str, Any]:
    return {"do_remote_prefill": True, "transfer_id": tid, "metaserver": url}


@pytest.fixture
def make_decoder(tiny_model: Path) -> Iterator[Callable[..., Scheduler]]:
    made: list[Scheduler] = []

    def make(url: str, *, register: bool = True, **extra: Any) -> Scheduler:
        cfg = H.vllm_config(
            tiny_model,
            "kv_consumer",
            {
                "metaserver_url": url,
                "metaserver_token": TOKEN,
                "instance_id": "decoder-0",
                "side_channel_host": "127.0.0.1",
                "side_channel_port": 5700,
                "heartbeat_s": 0.5,
                **extra,
            },
        )
        s = H.scheduler(cfg)
        made.append(s)
        if register:
            assert H.connector_of(s).scheduler.registrar.registered.wait(10)  # type: ignore[union-attr]
        return s

    try:
        yield make
    finally:
        for s in made:
            H.connector_of(s).shutdown()


def test_decode_matching_is_side_effect_free(
    metaserver: InThreadMetaserver, make_decoder: Callable[..., Scheduler]
) -> None:
    s = make_decoder(metaserver.url)
    conn = H.connector_of(s)
    req = H.request(H.prompt(50), _recv_params("tid-pure"))
    answers = {conn.get_num_new_matched_tokens(req, 0) for _ in range(5)}
    assert answers == {(50, True)}
    assert conn.get_num_new_matched_tokens(req, 32) == (18, True)
    assert conn.scheduler is not None and conn.scheduler.decode is not None
    assert conn.scheduler.decode.bindings_sent == 0
    assert conn.scheduler.writer.pending() == 0
    r = httpx.get(f"{metaserver.url}/v1/bindings/tid-pure", headers=AUTH)
    assert r.status_code == 404
    plain = H.request(H.prompt(50), None)
    assert conn.get_num_new_matched_tokens(plain, 0) == (0, False)


def test_decode_binding_carries_blocks_endpoint_and_identity(
    metaserver: InThreadMetaserver, make_decoder: Callable[..., Scheduler]
) -> None:
    s = make_decoder(metaserver.url)
    req = H.request(H.prompt(40), _recv_params("tid-bind"))
    s.add_request(req)
    _, meta = H.step(s)
    assert req.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    blocks = H.block_ids(s, req.request_id)
    assert [(r.req_id, r.transfer_id, r.block_ids) for r in meta.recvs] == [
        (req.request_id, "tid-bind", blocks)
    ]
    b = _wait_binding(metaserver.url, "tid-bind")
    assert b["request_id"] == req.request_id
    assert b["decode_instance_id"] == "decoder-0"
    assert b["engine_id"] == s.vllm_config.kv_transfer_config.engine_id  # type: ignore[union-attr]
    assert b["kv_endpoint"] == {"host": "127.0.0.1", "port": 5700}
    assert b["block_ids"] == [blocks] and len(blocks) == 3  # ceil(40 / 16)
    assert b["block_size"] == H.BLOCK
    assert b["num_prompt_tokens"] == 40 and b["num_cached_tokens"] == 0
    assert b["num_kv_heads"] == 2 and b["tp_size"] == 1 and b["use_mla"] is False
    # D's deadline: its kv_load_timeout_s (default 120 s) from now, on its own clock
    assert time.time() + 100 < b["load_deadline"] <= time.time() + 120


def test_decode_prefix_cache_hit_is_not_requested_from_prefill(
    metaserver: InThreadMetaserver, make_decoder: Callable[..., Scheduler]
) -> None:
    s = make_decoder(metaserver.url)
    shared = H.prompt(40, seed=1)
    local = H.request(shared, None, max_tokens=1)
    s.add_request(local)
    for _ in range(3):
        H.step(s)
    assert not s.requests  # finished, its full blocks stay in the prefix cache
    req = H.request(shared[:32] + H.prompt(20, seed=2), _recv_params("tid-cached"))
    s.add_request(req)
    _, meta = H.step(s)
    assert req.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    assert meta.recvs and meta.recvs[0].req_id == req.request_id
    b = _wait_binding(metaserver.url, "tid-cached")
    assert b["num_cached_tokens"] == 32  # two full cached blocks: P skips them
    assert b["num_prompt_tokens"] == 52
    assert len(b["block_ids"][0]) == 4


def test_decode_schedule_never_waits_for_a_slow_metaserver(
    metaserver: InThreadMetaserver, make_decoder: Callable[..., Scheduler]
) -> None:
    """D's scheduler step queues its binding writes and returns; the metaserver (behind a
    proxy that holds every call until the test lets it through) answers none meanwhile."""
    through = threading.Event()
    slow = SlowProxy(metaserver.url, delay_s=0.0, hold=through)
    try:
        s = make_decoder(slow.url, register=False, heartbeat_s=10.0)
        httpx.put(  # register directly so the (slow) binding write is accepted later
            f"{metaserver.url}/v1/instances/decoder-0",
            json={
                "role": "decode",
                "url": "http://127.0.0.1:8000",
                "kv_endpoint": {"host": "127.0.0.1", "port": 5700},
            },
            headers={"authorization": f"Bearer {TOKEN}"},
        ).raise_for_status()
        reqs = [H.request(H.prompt(30, seed=i), _recv_params(f"tid-slow-{i}")) for i in range(4)]
        for r in reqs:
            s.add_request(r)
        stepped: list[tuple[Any, PdgateMetadata]] = []
        step = threading.Thread(target=lambda: stepped.append(H.step(s)), daemon=True)
        step.start()
        step.join(30)  # right: a step's milliseconds; wrong: for ever (nothing is let through)
        assert stepped, "schedule() waited for the metaserver"
        _, meta = stepped[0]
        # schedule() returned before the metaserver could have answered a single write:
        missing = httpx.get(f"{metaserver.url}/v1/bindings/tid-slow-0", headers=AUTH)
        assert missing.status_code == 404
        assert len(meta.recvs) == 4
        assert all(r.status == RequestStatus.WAITING_FOR_REMOTE_KVS for r in reqs)
        through.set()
        for i in range(4):  # ... and every write still lands afterwards
            assert _wait_binding(metaserver.url, f"tid-slow-{i}", 20)["request_id"]
    finally:
        slow.close()


def test_decode_rejected_binding_fails_the_load_at_once(
    metaserver: InThreadMetaserver, make_decoder: Callable[..., Scheduler]
) -> None:
    # registered at another KV endpoint than the binding names -> 422 from the metaserver
    s = make_decoder(metaserver.url, register=False)
    conn = H.connector_of(s)
    assert conn.scheduler is not None
    conn.scheduler.registrar.close(deregister=False)
    httpx.put(
        f"{metaserver.url}/v1/instances/decoder-0",
        json={
            "role": "decode",
            "url": "http://127.0.0.1:8000",
            "kv_endpoint": {"host": "127.0.0.1", "port": 9999},
        },
        headers={"authorization": f"Bearer {TOKEN}"},
    ).raise_for_status()
    req = H.request(H.prompt(30), _recv_params("tid-rejected"))
    s.add_request(req)
    H.step(s)
    failed: list[str] = []
    deadline = time.monotonic() + 10
    while not failed and time.monotonic() < deadline:
        time.sleep(0.05)
        _, meta = H.step(s)
        failed = meta.failed_recvs
    assert failed == [req.request_id]


def _abort_and_watch(s: Scheduler, req_id: str, seconds: float) -> list[str]:
    """Abort ``req_id`` (waiting for its KV) and collect what the scheduler tells the worker to
    release at once, for up to ``seconds``."""
    s.finish_requests(req_id, RequestStatus.FINISHED_ABORTED)
    released: list[str] = []
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline and not released:
        _, meta = H.step(s)
        released += meta.released_recvs
        time.sleep(0.02)
    return released


def test_decode_abort_before_p_took_the_binding_frees_the_blocks_at_once(
    metaserver: InThreadMetaserver, make_decoder: Callable[..., Scheduler]
) -> None:
    s = make_decoder(metaserver.url)
    decode = H.connector_of(s).scheduler.decode  # type: ignore[union-attr]
    assert decode is not None
    # D's clock stands still: no deadline of D's can free the blocks, only the abort's word
    decode._clock = FakeClock()
    before = H.free_blocks(s)
    req = H.request(H.prompt(40), _recv_params("tid-abort-early"))
    s.add_request(req)
    H.step(s)
    _wait_binding(metaserver.url, "tid-abort-early")
    assert H.free_blocks(s) == before - 3
    assert _abort_and_watch(s, req.request_id, 30.0) == [req.request_id]  # 30 s: a hang
    final = httpx.get(f"{metaserver.url}/v1/bindings/tid-abort-early", headers=AUTH).json()
    assert final["state"] == "aborted"  # P's compare-and-set can no longer win
    assert [e["actor"] for e in final["events"]] == ["decoder-0", "decoder-0"]
    H.step(s, recving={req.request_id})  # the worker finishes it on that word
    H.step(s)
    H.assert_empty(s)
    assert H.connector_of(s).scheduler.decode.released == 1  # type: ignore[union-attr]


@pytest.mark.parametrize("ended_by_proxy", [False, True])
def test_decode_abort_after_p_took_the_binding_keeps_blocks_until_worker_releases(
    metaserver: InThreadMetaserver, make_decoder: Callable[..., Scheduler], ended_by_proxy: bool
) -> None:
    s = make_decoder(metaserver.url)
    before = H.free_blocks(s)
    tid = f"tid-abort-late-{ended_by_proxy}"
    req = H.request(H.prompt(40), _recv_params(tid))
    s.add_request(req)
    H.step(s)
    _wait_binding(metaserver.url, tid)
    events = f"{metaserver.url}/v1/bindings/{tid}/events"
    auth = {"authorization": f"Bearer {TOKEN}"}
    taken = httpx.post(events, json={"state": "prefill_started", "actor": "p"}, headers=auth)
    assert taken.status_code == 200, taken.text
    if ended_by_proxy:  # the proxy's abort lands first: D's own is a conflict
        r = httpx.post(events, json={"state": "aborted", "actor": "proxy"}, headers=auth)
        assert r.status_code == 200, r.text
    assert _abort_and_watch(s, req.request_id, 1.5) == []
    assert H.free_blocks(s) == before - 3  # P may still be writing: blocks stay
    assert H.connector_of(s).request_finished(req, []) == (False, None)
    assert H.connector_of(s).scheduler.decode.held == 1  # type: ignore[union-attr]
    H.step(s, recving={req.request_id})  # worker: P confirmed or deadline passed
    H.step(s)
    H.assert_empty(s)


def test_decode_finished_load_is_not_ended_again(
    metaserver: InThreadMetaserver, make_decoder: Callable[..., Scheduler]
) -> None:
    s = make_decoder(metaserver.url)
    req = H.request(H.prompt(40), _recv_params("tid-loaded"), max_tokens=50)
    s.add_request(req)
    H.step(s)
    _wait_binding(metaserver.url, "tid-loaded")
    H.step(s, recving={req.request_id})  # the KV is in; the request decodes
    H.step(s)
    assert _abort_and_watch(s, req.request_id, 0.5) == []
    decode = H.connector_of(s).scheduler.decode  # type: ignore[union-attr]
    assert decode is not None and decode.held == decode.released == 0
    state = httpx.get(f"{metaserver.url}/v1/bindings/tid-loaded", headers=AUTH).json()["state"]
    assert state == "bound"  # no abort posted for a request that was not waiting any more


def test_decode_request_loads_then_decodes_and_is_not_claimed_twice(
    metaserver: InThreadMetaserver, make_decoder: Callable[..., Scheduler]
) -> None:
    s = make_decoder(metaserver.url)
    conn = H.connector_of(s)
    req = H.request(H.prompt(40), _recv_params("tid-ok"), max_tokens=3)
    s.add_request(req)
    H.step(s)
    H.step(s, recving={req.request_id})
    out, meta = H.step(s)
    assert req.request_id in out.num_scheduled_tokens
    assert out.num_scheduled_tokens[req.request_id] == 1  # only the last prompt token
    assert meta == PdgateMetadata()
    # a recompute after a failure must not ask P again
    assert conn.get_num_new_matched_tokens(req, 0) == (0, False)
    for _ in range(4):
        H.step(s)
    H.assert_empty(s)


def test_decode_times_a_loaded_request_from_its_kv_ready_to_its_first_step(
    metaserver: InThreadMetaserver, make_decoder: Callable[..., Scheduler]
) -> None:
    s = make_decoder(metaserver.url)
    conn = H.connector_of(s)
    assert conn.scheduler is not None
    ok = H.request(H.prompt(40), _recv_params("tid-ready"), max_tokens=2)
    gone = H.request(H.prompt(40, seed=1), _recv_params("tid-ready-gone"), max_tokens=2)
    s.add_request(ok)
    s.add_request(gone)
    H.step(s)
    H.connector_stats()
    conn.scheduler.stats.take()
    ready_at = time.time() - 0.05  # the worker saw the KV complete 50 ms before reporting
    H.step(s, recving={ok.request_id, gone.request_id},
           ready={ok.request_id: ready_at, gone.request_id: ready_at})  # fmt: skip
    s.finish_requests(gone.request_id, RequestStatus.FINISHED_ABORTED)  # before its first step
    out, _ = H.step(s, stats={"loads": 0})  # (vLLM 0.23 ships the scheduler's stats with these)
    assert out.num_scheduled_tokens == {ok.request_id: 1}
    waits = stats.merge(H.connector_stats(), conn.scheduler.stats.take() or {})
    (wait,) = waits["kv_ready_wait_seconds"]  # one wait: the aborted request was never scheduled
    assert 0.05 <= wait < 5
    assert not conn.scheduler.ready  # nothing left pending
    for _ in range(4):
        H.step(s)
    H.assert_empty(s)


def test_decode_failed_load_is_recomputed_locally(
    metaserver: InThreadMetaserver, make_decoder: Callable[..., Scheduler]
) -> None:
    s = make_decoder(metaserver.url)
    req = H.request(H.prompt(40), _recv_params("tid-fail"), max_tokens=2)
    s.add_request(req)
    H.step(s)
    H.step(s, recving={req.request_id}, failed={req.request_id})
    out, meta = H.step(s)
    assert out.num_scheduled_tokens.get(req.request_id) == 40  # whole prompt, locally
    assert meta.recvs == []
    for _ in range(4):
        H.step(s)
    H.assert_empty(s)


WRITE_TIMEOUT_S = 7  # not the default (10): the hold below must follow the setting


def late_landing_hold(write_timeout_s: int) -> float:
    """D's late-landing hold after a failed load, by the documented rule (docs/operating.md,
    docs/connector.md): Mooncake's write deadline, then its longest lane deadline (the connector
    sets both to ``write_timeout_s``), plus 2 s."""
    return 2 * write_timeout_s + 2.0


@pytest.mark.parametrize("write_timeout_s", [5, 13])
def test_decode_late_landing_hold_follows_write_timeout_s(
    metaserver: InThreadMetaserver, make_decoder: Callable[..., Scheduler], write_timeout_s: int
) -> None:
    """Two settings, two holds: a hold fixed at the default's value fails both."""
    s = make_decoder(metaserver.url, register=False, write_timeout_s=write_timeout_s)
    decode = H.connector_of(s).scheduler.decode  # type: ignore[union-attr]
    assert decode is not None
    assert decode.late_landing_s == late_landing_hold(write_timeout_s)


def test_decode_load_failed_for_a_silent_p_recomputes_in_other_blocks_until_the_deadline(
    metaserver: InThreadMetaserver, make_decoder: Callable[..., Scheduler]
) -> None:
    if not features().bind_manager:
        pytest.skip("this vLLM never hands the connector its KVCacheManager: silence_s is off")
    s = make_decoder(metaserver.url, kv_load_timeout_s=2.0, write_timeout_s=WRITE_TIMEOUT_S)
    decode = H.connector_of(s).scheduler.decode  # type: ignore[union-attr]
    assert decode is not None and decode.late_landing_s == late_landing_hold(WRITE_TIMEOUT_S)
    decode.late_landing_s = 1.0
    # D's deadlines on a clock the test moves (vLLM builds the connector, so it is set here)
    clock = FakeClock()
    decode._clock = clock
    before = H.free_blocks(s)
    req = H.request(H.prompt(40), _recv_params("tid-silent"), max_tokens=2)
    s.add_request(req)
    H.step(s)
    loading = H.block_ids(s, req.request_id)
    assert len(loading) == 3
    rid = req.request_id
    # the worker: P went silent, the load failed; a frozen P may still write those blocks
    H.step(s, recving={rid}, failed={rid}, silent={rid})
    out, _ = H.step(s)
    assert out.num_scheduled_tokens.get(rid) == 40  # recomputed at once …
    assert not set(H.block_ids(s, rid)) & set(loading)  # … into other blocks
    for _ in range(4):
        H.step(s)
    assert not s.requests  # answered
    assert H.free_blocks(s) == before - 3  # the silent P's blocks are still out of use
    assert decode.quarantined_blocks == 3
    # no request left, yet the engine must keep stepping: an idle vLLM takes no step, and
    # the quarantine ends only at one
    assert s.has_requests()
    clock.advance(2.0)
    H.step(s)  # D's deadline passed, but a write P had in flight may still land
    assert H.free_blocks(s) == before - 3 and s.has_requests()
    clock.advance(1.0)
    H.step(s)  # past the deadline and the late-landing hold: they go back
    assert H.free_blocks(s) == before and decode.quarantined_blocks == 0
    assert not s.has_requests()  # and the engine may idle
    H.assert_empty(s)


def test_decode_traced_binding_records_a_bind_span(
    metaserver: InThreadMetaserver,
    make_decoder: Callable[..., Scheduler],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """With ``otlp_traces_endpoint``, a request carrying the proxy's context gets a
    ``pdgate.connector.bind`` span under it (exported over OTLP/HTTP), and the worker half is
    handed the context; a request without one gets neither."""
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "http/protobuf")
    tp = format_traceparent(0xA1B2C3D4E5F60718293A4B5C6D7E8F90, 0x1122334455667788, 1)
    with otlp_receiver() as receiver:
        s = make_decoder(metaserver.url, otlp_traces_endpoint=receiver.url)
        traced = H.request(H.prompt(40), {**_recv_params("tid-traced"), "traceparent": tp})
        plain = H.request(H.prompt(40, seed=3), _recv_params("tid-plain"))
        s.add_request(traced)
        s.add_request(plain)
        _, meta = H.step(s)
        by_req = {r.req_id: r.traceparent for r in meta.recvs}
        assert by_req == {traced.request_id: tp, plain.request_id: ""}
        _wait_binding(metaserver.url, "tid-traced")
        _wait_binding(metaserver.url, "tid-plain")
        sched = H.connector_of(s).scheduler
        assert sched is not None and sched.tracer is not None
        deadline = time.monotonic() + 10  # the span ends when the writer's PUT has returned
        while not receiver.spans and time.monotonic() < deadline:
            assert sched.tracer.provider.force_flush(10_000)
            time.sleep(0.05)
        spans = receiver.spans
    (bind,) = spans
    assert bind.name == "pdgate.connector.bind" and bind.service == "pdgate-connector"
    assert bind.trace_id == f"{0xA1B2C3D4E5F60718293A4B5C6D7E8F90:032x}"
    assert bind.parent_span_id == "1122334455667788"
    assert bind.attributes["pdgate.transfer_id"] == "tid-traced"
    assert bind.attributes["pdgate.blocks"] == 3 and bind.attributes["pdgate.prompt_tokens"] == 40
    assert [e.name for e in bind.events] == ["binding_written"]
    assert bind.resource["pdgate.instance_id"] == "decoder-0"


def test_decode_stats_time_the_binding_write_and_count_blocks_held_until_loaded(
    metaserver: InThreadMetaserver, make_decoder: Callable[..., Scheduler]
) -> None:
    s = make_decoder(metaserver.url)
    conn = H.connector_of(s)
    assert conn.scheduler is not None
    H.connector_stats()
    req = H.request(H.prompt(40), _recv_params("tid-stats"))
    s.add_request(req)
    H.step(s)
    _wait_binding(metaserver.url, "tid-stats")
    deadline = time.monotonic() + 10
    while conn.scheduler.writer.pending() and time.monotonic() < deadline:
        time.sleep(0.01)
    H.step(s)  # the writer's answer is shipped with the next output
    early = H.connector_stats()
    # the worker ended the load, and counted it
    H.step(s, recving={req.request_id}, stats={"loads": 1})
    late = H.connector_stats()
    if H.SCHEDULER_STATS_ALONE:
        assert early["blocks_held"] == {"decode": 3}  # ceil(40 / 16) blocks wait for P's KV
        assert late["blocks_held"] == {"decode": -3}
    total = stats.merge(early, late)
    assert total["binding_writes"] == {"ok": 1} and total["loads"] == 1
    (latency,) = total["binding_write_seconds"]
    assert 0 < latency < 10
