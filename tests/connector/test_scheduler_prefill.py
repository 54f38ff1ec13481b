"""Prefill-side scheduler half, driven by vLLM's real Scheduler against a real metaserver."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.request import RequestStatus

from connector.metadata import Abandoned, SendChunk
from pdwire.version import PROTOCOL_VERSION
from tests.connector import harness as H
from tests.support.procs import until
from tests.support.services import InThreadMetaserver

TOKEN = "t0ken"
AUTH = {"authorization": f"Bearer {TOKEN}"}
D_ENDPOINT = {"host": "127.0.0.1", "port": 5800}


def _register_decoder(url: str, instance: str = "dec-1") -> None:
    httpx.put(
        f"{url}/v1/instances/{instance}",
        json={"role": "decode", "url": "http://127.0.0.1:8001", "kv_endpoint": D_ENDPOINT},
        headers=AUTH,
    ).raise_for_status()


def _deregister_decoder(url: str, instance: str = "dec-1") -> None:
    httpx.delete(f"{url}/v1/instances/{instance}", headers=AUTH).raise_for_status()


def _bind(
    url: str,
    tid: str,
    prompt_len: int,
    *,
    cached: int = 0,
    first: int = 100,
    tp_size: int = 1,
    load_deadline: float | None = None,
    protocol: int = PROTOCOL_VERSION,
) -> dict[str, Any]:
    n = -(-prompt_len // H.BLOCK)
    spec = {
        "request_id": f"d-{tid}",
        "decode_instance_id": "dec-1",
        "engine_id": "d-engine",
        "kv_endpoint": D_ENDPOINT,
        "block_size": H.BLOCK,
        "block_ids": [list(range(first, first + n))],
        "num_cached_tokens": cached,
        "num_prompt_tokens": prompt_len,
        "num_kv_heads": 2,
        "tp_size": tp_size,
        "protocol": protocol,
    }
    if load_deadline is not None:
        spec["load_deadline"] = load_deadline
    r = httpx.put(f"{url}/v1/bindings/{tid}", json=spec, headers=AUTH)
    assert r.status_code in (200, 201), r.text
    body: dict[str, Any] = httpx.get(f"{url}/v1/bindings/{tid}", headers=AUTH).json()
    return body


def _send_params(tid: str, binding: dict[str, Any] | None) -> dict[str, Any]:
    p: dict[str, Any] = {"do_remote_decode": True, "transfer_id": tid, "metaserver": "x"}
    if binding is not None:
        p["decode"] = binding
    return p


@pytest.fixture
def make_prefiller(tiny_model: Path) -> Iterator[Callable[..., Scheduler]]:
    made: list[Scheduler] = []

    def make(url: str, *, batched: int = 40, **extra: Any) -> Scheduler:
        cfg = H.vllm_config(
            tiny_model,
            "kv_producer",
            {
                "metaserver_url": url,
                "metaserver_token": TOKEN,
                "instance_id": "pre-1",
                "side_channel_host": "127.0.0.1",
                **extra,
            },
            batched_tokens=batched,
        )
        s = H.scheduler(cfg)
        made.append(s)
        return s

    try:
        yield make
    finally:
        for s in made:
            H.connector_of(s).shutdown()


def _step_until_scheduled(s: Scheduler, req_id: str, limit: float = 10.0) -> tuple[Any, Any]:
    deadline = time.monotonic() + limit
    while time.monotonic() < deadline:
        out, meta = H.step(s)
        if req_id in out.num_scheduled_tokens:
            return out, meta
        time.sleep(0.02)
    raise AssertionError(f"{req_id} never scheduled")


def _pushes(meta: Any, req_id: str) -> list[SendChunk]:
    return [c for c in meta.sends if c.req_id == req_id]


def test_prefill_chunks_push_complete_blocks_and_tail_last(
    metaserver: InThreadMetaserver, make_prefiller: Callable[..., Scheduler]
) -> None:
    _register_decoder(metaserver.url)
    s = make_prefiller(metaserver.url, batched=40)  # chunks 0-40, 40-80, 80-100
    b = _bind(metaserver.url, "tid-chunks", 100)
    req = H.request(H.prompt(100), _send_params("tid-chunks", b), max_tokens=1)
    s.add_request(req)
    out, meta = _step_until_scheduled(s, req.request_id)
    p = H.block_ids(s, req.request_id)
    d = b["block_ids"][0]
    seen: list[tuple[list[tuple[int, int]], bool]] = []
    c = _pushes(meta, req.request_id)
    seen.append((c[0].pairs, c[0].last))
    for _ in range(2):
        out, meta = H.step(s)
        p = H.block_ids(s, req.request_id)
        c = _pushes(meta, req.request_id)
        seen.append((c[0].pairs, c[0].last))
    assert seen == [
        ([(p[i], d[i]) for i in range(2)], False),  # 40 tokens: 2 full blocks
        ([(p[i], d[i]) for i in range(2, 5)], False),  # up to 80: blocks 2..4
        ([(p[i], d[i]) for i in range(5, 7)], True),  # last chunk: block 5 + tail block 6
    ]
    assert c[0].dest.host == "127.0.0.1" and c[0].dest.port == 5800
    assert c[0].dest.engine_id == "d-engine" and c[0].transfer_id == "tid-chunks"


def test_prefill_skips_blocks_decode_already_caches(
    metaserver: InThreadMetaserver, make_prefiller: Callable[..., Scheduler]
) -> None:
    _register_decoder(metaserver.url)
    s = make_prefiller(metaserver.url, batched=64)
    b = _bind(metaserver.url, "tid-skip", 70, cached=32)
    req = H.request(H.prompt(70), _send_params("tid-skip", b), max_tokens=1)
    s.add_request(req)
    _, meta = _step_until_scheduled(s, req.request_id)
    p, d = H.block_ids(s, req.request_id), b["block_ids"][0]
    first = _pushes(meta, req.request_id)[0]
    assert first.pairs == [(p[i], d[i]) for i in range(2, 4)]  # blocks 0,1 are on D already
    _, meta = H.step(s)
    p = H.block_ids(s, req.request_id)
    last = _pushes(meta, req.request_id)[0]
    assert last.last and last.pairs == [(p[4], d[4])]


def test_prefill_keeps_blocks_until_every_push_ended(
    metaserver: InThreadMetaserver, make_prefiller: Callable[..., Scheduler]
) -> None:
    _register_decoder(metaserver.url)
    s = make_prefiller(metaserver.url, batched=64)
    H.connector_stats()  # drop what earlier tests shipped
    before = H.free_blocks(s)
    b = _bind(metaserver.url, "tid-free", 50)
    req = H.request(H.prompt(50), _send_params("tid-free", b), max_tokens=1)
    s.add_request(req)
    _step_until_scheduled(s, req.request_id)
    assert req.status == RequestStatus.FINISHED_LENGTH_CAPPED
    for _ in range(3):
        H.step(s)
    assert H.free_blocks(s) < before  # finished, but pushes may still read the blocks
    held = H.connector_stats().get("blocks_held")
    H.step(s, sending={req.request_id}, stats={"transfers": {"ok": 1}})
    H.assert_empty(s)
    released = H.connector_stats()["blocks_held"]
    if H.SCHEDULER_STATS_ALONE:  # vLLM 0.23 ships them with the workers' next stats
        assert held == {"prefill": 4}  # ceil(50 / 16)
        assert released == {"prefill": -4}


def test_prefill_concurrent_mode_asks_later_until_binding_arrives(
    metaserver: InThreadMetaserver, make_prefiller: Callable[..., Scheduler]
) -> None:
    _register_decoder(metaserver.url)
    s = make_prefiller(metaserver.url, batched=64, concurrent=True)
    before = H.free_blocks(s)
    req = H.request(H.prompt(50), _send_params("tid-conc", None), max_tokens=1)
    s.add_request(req)
    for _ in range(5):
        out, meta = H.step(s)
        assert req.request_id not in out.num_scheduled_tokens
        assert H.free_blocks(s) == before  # holds no blocks while waiting
        time.sleep(0.05)
    b = _bind(metaserver.url, "tid-conc", 50, first=7)
    out, meta = _step_until_scheduled(s, req.request_id)
    chunk = _pushes(meta, req.request_id)[0]
    assert chunk.last and [dst for _, dst in chunk.pairs] == b["block_ids"][0]


def test_prefill_refuses_destinations_the_registry_does_not_vouch_for(
    metaserver: InThreadMetaserver, make_prefiller: Callable[..., Scheduler]
) -> None:
    _register_decoder(metaserver.url)
    s = make_prefiller(metaserver.url, batched=64, registry_grace_s=0.5)
    b = _bind(metaserver.url, "tid-forged", 40)
    forged = {**b, "kv_endpoint": {"host": "10.6.6.6", "port": 5800}}
    req = H.request(H.prompt(40), _send_params("tid-forged", forged), max_tokens=1)
    s.add_request(req)
    t0 = time.monotonic()
    out, meta = _step_until_scheduled(s, req.request_id)
    assert time.monotonic() - t0 >= 0.5  # the registry's no was asked again for the grace
    assert meta.sends == []  # computed, answered, but nothing pushed anywhere
    assert H.FINISHED_PARAMS[req.request_id] == {  # P's answer tells the proxy
        "transfer_id": "tid-forged",
        "push": "none",
        "reason": "the registry does not vouch for dec-1 at 10.6.6.6:5800",
    }
    unknown = {**b, "decode_instance_id": "nobody"}
    req2 = H.request(H.prompt(40, seed=3), _send_params("tid-forged", unknown), max_tokens=1)
    s.add_request(req2)
    out, meta = _step_until_scheduled(s, req2.request_id)
    assert meta.sends == []
    for _ in range(2):
        H.step(s)
    H.assert_empty(s)  # no delay-free for requests that never pushed


def test_prefill_refuses_a_binding_naming_another_decode_than_the_proxy_chose(
    metaserver: InThreadMetaserver, make_prefiller: Callable[..., Scheduler]
) -> None:
    """A real, vouched-for binding of another decode (written under this transfer id by
    someone else): P told which D the proxy chose pushes nothing into it. The concurrent flow,
    where P fetches the binding itself, had no such check (security_review_2 N15)."""
    _register_decoder(metaserver.url)
    s = make_prefiller(metaserver.url, batched=64)
    b = _bind(metaserver.url, "tid-other", 40)  # names dec-1, registered at its endpoint
    params = _send_params("tid-other", b) | {"decode_instance": "dec-2"}
    req = H.request(H.prompt(40), params, max_tokens=1)
    s.add_request(req)
    out, meta = _step_until_scheduled(s, req.request_id)
    assert meta.sends == []
    assert H.FINISHED_PARAMS[req.request_id] == {
        "transfer_id": "tid-other",
        "push": "none",
        "reason": "the binding names dec-1, the proxy chose dec-2",
    }
    ok = H.request(H.prompt(40, seed=5), _send_params("tid-ok", _bind(metaserver.url, "tid-ok", 40))
                   | {"decode_instance": "dec-1"}, max_tokens=1)  # fmt: skip
    s.add_request(ok)
    out, meta = _step_until_scheduled(s, ok.request_id)
    assert [x.transfer_id for x in meta.sends] == ["tid-ok"]  # the chosen D's: pushed


def test_prefill_pushes_once_a_lapsed_decoder_registers_again_within_the_grace(
    metaserver: InThreadMetaserver, make_prefiller: Callable[..., Scheduler]
) -> None:
    _register_decoder(metaserver.url)
    s = make_prefiller(metaserver.url, batched=64, heartbeat_s=0.2, registry_grace_s=30)
    b = _bind(metaserver.url, "tid-lapse", 40)
    # D's heartbeat lapsed (a starved host): the registry has forgotten it when P first asks
    _deregister_decoder(metaserver.url)
    req = H.request(H.prompt(40), _send_params("tid-lapse", b), max_tokens=1)
    s.add_request(req)
    deadline = time.monotonic() + 1.0
    while time.monotonic() < deadline:  # P asked, heard no, and keeps the request waiting
        out, _ = H.step(s)
        assert req.request_id not in out.num_scheduled_tokens
        time.sleep(0.05)
    _register_decoder(metaserver.url)  # the next heartbeat lands
    out, meta = _step_until_scheduled(s, req.request_id)
    chunk = _pushes(meta, req.request_id)[0]
    assert chunk.last and [dst for _, dst in chunk.pairs] == b["block_ids"][0]
    assert H.FINISHED_PARAMS[req.request_id] == {"transfer_id": "tid-lapse", "push": "started"}


def test_prefill_does_not_refuse_on_an_old_no_from_the_registry(
    metaserver: InThreadMetaserver, make_prefiller: Callable[..., Scheduler]
) -> None:
    s = make_prefiller(metaserver.url, batched=64, heartbeat_s=60, registry_grace_s=0)
    _register_decoder(metaserver.url)
    b = _bind(metaserver.url, "tid-old-no", 40, first=10)
    _deregister_decoder(metaserver.url)
    first = H.request(H.prompt(40), _send_params("tid-old-no", b), max_tokens=1)
    s.add_request(first)
    _, meta = _step_until_scheduled(s, first.request_id)
    assert meta.sends == []  # no grace: refused on the registry's no
    _register_decoder(metaserver.url)
    time.sleep(0.6)  # the no is older than its short cache life; a yes would be kept 60 s
    b2 = _bind(metaserver.url, "tid-old-no-2", 40, first=20)
    second = H.request(H.prompt(40, seed=4), _send_params("tid-old-no-2", b2), max_tokens=1)
    s.add_request(second)
    _, meta = _step_until_scheduled(s, second.request_id)
    assert [dst for _, dst in _pushes(meta, second.request_id)[0].pairs] == b2["block_ids"][0]


def test_prefill_abort_mid_prefill_holds_blocks_until_workers_release(
    metaserver: InThreadMetaserver, make_prefiller: Callable[..., Scheduler]
) -> None:
    _register_decoder(metaserver.url)
    s = make_prefiller(metaserver.url, batched=40)
    b = _bind(metaserver.url, "tid-pabort", 100)
    req = H.request(H.prompt(100), _send_params("tid-pabort", b), max_tokens=1)
    s.add_request(req)
    _, meta = _step_until_scheduled(s, req.request_id)
    assert _pushes(meta, req.request_id)
    s.finish_requests(req.request_id, RequestStatus.FINISHED_ABORTED)
    out, meta = H.step(s)
    assert req.request_id in out.finished_req_ids
    assert req.request_id in s.requests  # delay-freed
    H.step(s, sending={req.request_id})
    H.assert_empty(s)


def _state(url: str, tid: str) -> str:
    state: str = httpx.get(f"{url}/v1/bindings/{tid}", headers=AUTH).json()["state"]
    return state


def _abandoned(s: Scheduler, limit: float = 5.0) -> list[Abandoned]:
    """Step until a step's metadata closes leases; they, and nothing more in later steps."""
    deadline = time.monotonic() + limit
    while time.monotonic() < deadline:
        _, meta = H.step(s)
        if meta.abandoned:
            for _ in range(3):
                assert H.step(s)[1].abandoned == []  # closed once
            return meta.abandoned
        time.sleep(0.02)
    raise AssertionError("no lease closed")


def test_prefill_abort_before_any_chunk_closes_the_lease(
    metaserver: InThreadMetaserver, make_prefiller: Callable[..., Scheduler]
) -> None:
    """P took the lease and its request was aborted before any block went to the workers (D
    had the first 32 tokens cached; the 16-token chunk completed none after them): the next
    step hands the lease to the workers, who tell D at once instead of D holding its blocks
    until its load deadline. P's blocks are not held: nothing reads them."""
    _register_decoder(metaserver.url)
    s = make_prefiller(metaserver.url, batched=16)
    b = _bind(metaserver.url, "tid-early", 100, cached=32)
    req = H.request(H.prompt(100), _send_params("tid-early", b), max_tokens=1)
    s.add_request(req)
    _, meta = _step_until_scheduled(s, req.request_id)
    assert _pushes(meta, req.request_id) == []  # leased, nothing sent yet
    assert _state(metaserver.url, "tid-early") == "prefill_started"
    s.finish_requests(req.request_id, RequestStatus.FINISHED_ABORTED)
    (lease,) = _abandoned(s)
    assert (lease.transfer_id, lease.dest.instance_id) == ("tid-early", "dec-1")
    H.assert_empty(s)


def test_prefill_abort_while_its_claim_is_unread_closes_the_lease_once_won(
    metaserver: InThreadMetaserver, make_prefiller: Callable[..., Scheduler]
) -> None:
    """The claim is asynchronous: the request is aborted after P's ``prefill_started`` won
    in the metaserver, before P's scheduler read the answer (nothing scheduled yet)."""
    _register_decoder(metaserver.url)
    s = make_prefiller(metaserver.url, batched=64)
    b = _bind(metaserver.url, "tid-unread", 40)
    req = H.request(H.prompt(40), _send_params("tid-unread", b), max_tokens=1)
    s.add_request(req)
    for _ in range(50):
        out, _ = H.step(s)
        assert req.request_id not in out.num_scheduled_tokens
        try:  # a claim this step started wins within the wait; else step again
            until(lambda: _state(metaserver.url, "tid-unread") == "prefill_started", 0.3)
            break
        except AssertionError:
            continue
    else:
        raise AssertionError("P never claimed")
    s.finish_requests(req.request_id, RequestStatus.FINISHED_ABORTED)
    (lease,) = _abandoned(s)
    assert lease.transfer_id == "tid-unread"
    H.assert_empty(s)
    assert not H.connector_of(s).has_pending_push_work()


def test_prefill_abort_after_the_last_chunk_sends_no_second_close(
    metaserver: InThreadMetaserver, make_prefiller: Callable[..., Scheduler]
) -> None:
    _register_decoder(metaserver.url)
    s = make_prefiller(metaserver.url, batched=64)
    b = _bind(metaserver.url, "tid-whole", 40)
    req = H.request(H.prompt(40), _send_params("tid-whole", b), max_tokens=4)
    s.add_request(req)
    _, meta = _step_until_scheduled(s, req.request_id)
    assert [c.last for c in _pushes(meta, req.request_id)] == [True]
    s.finish_requests(req.request_id, RequestStatus.FINISHED_ABORTED)
    for _ in range(3):
        _, meta = H.step(s)
        assert (_pushes(meta, req.request_id), meta.abandoned) == ([], [])


def test_prefill_abort_before_binding_arrived_holds_nothing(
    metaserver: InThreadMetaserver, make_prefiller: Callable[..., Scheduler]
) -> None:
    s = make_prefiller(metaserver.url, batched=64, concurrent=True)
    req = H.request(H.prompt(50), _send_params("tid-never", None), max_tokens=1)
    s.add_request(req)
    H.step(s)
    s.finish_requests(req.request_id, RequestStatus.FINISHED_ABORTED)
    H.step(s)
    H.assert_empty(s)


def test_prefill_never_pushes_after_decodes_deadline(
    metaserver: InThreadMetaserver, make_prefiller: Callable[..., Scheduler]
) -> None:
    _register_decoder(metaserver.url)
    s = make_prefiller(metaserver.url, batched=64, kv_load_timeout_s=1.0)
    b = _bind(metaserver.url, "tid-late", 40)
    time.sleep(1.0)  # D (same kv_load_timeout_s) has given up by now
    req = H.request(H.prompt(40), _send_params("tid-late", b), max_tokens=1)
    s.add_request(req)
    out, meta = _step_until_scheduled(s, req.request_id)
    assert meta.sends == []
    for _ in range(2):
        H.step(s)
    H.assert_empty(s)


def test_prefill_obeys_the_deadline_the_binding_states(
    metaserver: InThreadMetaserver, make_prefiller: Callable[..., Scheduler]
) -> None:
    """D states its deadline in the binding: P (whose own kv_load_timeout_s is far longer)
    stops writing before it, so P and D need not share the setting."""
    _register_decoder(metaserver.url)
    s = make_prefiller(metaserver.url, batched=64, kv_load_timeout_s=600.0)
    b = _bind(metaserver.url, "tid-stated", 40, load_deadline=time.time() + 1.0)
    time.sleep(1.0)
    req = H.request(H.prompt(40), _send_params("tid-stated", b), max_tokens=1)
    s.add_request(req)
    _, meta = _step_until_scheduled(s, req.request_id)
    assert meta.sends == []
    half = H.connector_of(s).scheduler
    assert half is not None and half.prefill is not None and half.prefill.expired == 1


def test_prefill_refuses_a_decoder_of_another_protocol_version(
    metaserver: InThreadMetaserver, make_prefiller: Callable[..., Scheduler]
) -> None:
    """A D of another pdgate release (its binding says protocol 1): no push, and P's answer
    says why (push: none), so the proxy lets D compute the prompt at once."""
    _register_decoder(metaserver.url)
    s = make_prefiller(metaserver.url, batched=64)
    b = _bind(metaserver.url, "tid-proto", 40, protocol=1)
    req = H.request(H.prompt(40), _send_params("tid-proto", b), max_tokens=1)
    s.add_request(req)
    _, meta = _step_until_scheduled(s, req.request_id)
    assert meta.sends == []
    for _ in range(3):
        H.step(s)
    report = H.FINISHED_PARAMS[req.request_id]
    assert report is not None and report["push"] == "none"
    assert report["reason"].startswith(
        "protocol version mismatch: D dec-1 speaks pdgate protocol 1"
    )


def test_prefill_pushes_to_a_decoder_with_more_tp_ranks(
    metaserver: InThreadMetaserver, make_prefiller: Callable[..., Scheduler]
) -> None:
    """P tp=1 feeds D tp=2 (each D rank gets its half of P's heads): the push is planned."""
    _register_decoder(metaserver.url)
    s = make_prefiller(metaserver.url, batched=64)
    b = _bind(metaserver.url, "tid-tp2", 40, tp_size=2)
    req = H.request(H.prompt(40), _send_params("tid-tp2", b), max_tokens=1)
    s.add_request(req)
    out, meta = _step_until_scheduled(s, req.request_id)
    assert _pushes(meta, req.request_id)
    half = H.connector_of(s).scheduler
    assert half is not None and half.prefill is not None and half.prefill.refused == 0


def test_prefill_refuses_a_tp_pairing_that_cannot_map_heads_before_computing(
    metaserver: InThreadMetaserver, make_prefiller: Callable[..., Scheduler]
) -> None:
    """D tp=3 cannot hold D's 2 KV heads evenly: no push is planned, P's answer says why (P
    posts nothing on the binding: it never took it), and the request is still served (its KV
    just never leaves P)."""
    _register_decoder(metaserver.url)
    s = make_prefiller(metaserver.url, batched=64)
    b = _bind(metaserver.url, "tid-tp", 40, tp_size=3)
    req = H.request(H.prompt(40), _send_params("tid-tp", b), max_tokens=1)
    s.add_request(req)
    out, meta = _step_until_scheduled(s, req.request_id)
    assert meta.sends == []
    half = H.connector_of(s).scheduler
    assert half is not None and half.prefill is not None and half.prefill.refused == 1
    for _ in range(3):
        H.step(s)
    report = H.FINISHED_PARAMS[req.request_id]
    assert report is not None and report["push"] == "none"
    assert "tp 3 is not a multiple of 2 KV heads" in report["reason"]
    time.sleep(0.3)  # the background writer would have posted by now
    events = httpx.get(f"{metaserver.url}/v1/bindings/tid-tp", headers=AUTH).json()["events"]
    assert [e["state"] for e in events] == ["bound"]


def test_prefill_takes_the_lease_before_its_first_push(
    metaserver: InThreadMetaserver, make_prefiller: Callable[..., Scheduler]
) -> None:
    _register_decoder(metaserver.url)
    s = make_prefiller(metaserver.url, batched=40)
    b = _bind(metaserver.url, "tid-lease", 60)
    req = H.request(H.prompt(60), _send_params("tid-lease", b), max_tokens=1)
    s.add_request(req)
    out, meta = _step_until_scheduled(s, req.request_id)
    assert _pushes(meta, req.request_id)  # the first chunk's blocks go out …
    now = httpx.get(f"{metaserver.url}/v1/bindings/tid-lease", headers=AUTH).json()
    # … only after P's compare-and-set bound → prefill_started landed
    assert now["state"] == "prefill_started"
    assert [(e["state"], e["actor"]) for e in now["events"]] == [
        ("bound", "dec-1"),
        ("prefill_started", "pre-1"),
    ]


@pytest.mark.parametrize("ended", ["aborted", "failed"])
def test_prefill_pushes_nothing_into_a_binding_that_ended_before_p_took_it(
    metaserver: InThreadMetaserver, make_prefiller: Callable[..., Scheduler], ended: str
) -> None:
    _register_decoder(metaserver.url)
    s = make_prefiller(metaserver.url, batched=64)
    tid = f"tid-late-{ended}"
    b = _bind(metaserver.url, tid, 40)
    r = httpx.post(  # D's request was aborted first: it may free these blocks at once
        f"{metaserver.url}/v1/bindings/{tid}/events",
        json={"state": ended, "actor": "dec-1"},
        headers=AUTH,
    )
    assert r.status_code == 200, r.text
    req = H.request(H.prompt(40), _send_params(tid, b), max_tokens=1)
    s.add_request(req)
    out, meta = _step_until_scheduled(s, req.request_id)
    assert meta.sends == []  # computed and answered, nothing written into D's blocks
    for _ in range(2):
        out, meta = H.step(s)
        assert meta.sends == []
    report = H.FINISHED_PARAMS[req.request_id]
    assert report is not None
    assert report["push"] == "none" and report["transfer_id"] == tid
    assert report["reason"].startswith("the binding ended before P took it"), report
    assert ended in report["reason"], report
    assert httpx.get(f"{metaserver.url}/v1/bindings/{tid}", headers=AUTH).json()["state"] == ended
    H.assert_empty(s)


def test_prefill_pushes_nothing_when_the_requests_binding_is_not_the_stored_one(
    metaserver: InThreadMetaserver, make_prefiller: Callable[..., Scheduler]
) -> None:
    """The binding in P's request (passed on by a proxy, or by anyone who reaches P) names other
    blocks than the one D wrote: P takes the lease, sees the stored record differ, writes
    nothing and fails the transfer so D recomputes at once (another request's blocks are
    never overwritten)."""
    _register_decoder(metaserver.url)
    s = make_prefiller(metaserver.url, batched=64)
    tid = "tid-swapped"
    b = _bind(metaserver.url, tid, 40)
    swapped = {**b, "block_ids": [[7, 8, 9]]}  # another request's blocks on the same D
    req = H.request(H.prompt(40), _send_params(tid, swapped), max_tokens=1)
    s.add_request(req)
    out, meta = _step_until_scheduled(s, req.request_id)
    assert meta.sends == []
    for _ in range(2):
        out, meta = H.step(s)
        assert meta.sends == []
    report = H.FINISHED_PARAMS[req.request_id]
    assert report is not None and report["push"] == "none"
    assert report["reason"] == "the request's binding differs from the stored one in block_ids"
    record = httpx.get(f"{metaserver.url}/v1/bindings/{tid}", headers=AUTH).json()
    assert [e["state"] for e in record["events"]] == ["bound", "prefill_started", "failed"]
    H.assert_empty(s)
