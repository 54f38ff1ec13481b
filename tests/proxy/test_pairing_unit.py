"""Only compatible P and D are paired (revision, KV identity, TP), from their registrations in
the metaserver, in memory through ``tests.proxy.mock``. A D whose revision has no P left is served
alone (D computes the prompt) rather than paired across revisions."""

from __future__ import annotations

import logging
import time
from typing import Any

from pdwire.models import Instance as Registered
from pdwire.models import KVIdentity
from proxy.config import Flow
from tests.proxy.inmemory import D_URL, P_URL, InMemoryProxy
from tests.proxy.mock import MockBackend, Reply
from tests.support.identity import KV

P2_URL = "http://p1:8101"
D2_URL = "http://d1:8201"


def registered(
    iid: str, role: str, url: str, revision: str, kv: KVIdentity = KV, tp: int = 1
) -> Registered:
    now = time.time()
    return Registered(
        instance_id=iid,
        role=role,
        url=url,
        tp_size=tp,
        revision=revision,
        kv=kv,
        registered_at=now,
        last_heartbeat=now,
        expires_at=now + 30,
    )


def _proxy(backend: MockBackend) -> InMemoryProxy:
    return InMemoryProxy(
        backend,
        Flow.PREFILL_FIRST,
        prefill=[P_URL, P2_URL],
        decode=[D_URL, D2_URL],
        prefill_policy="round_robin",
        decode_policy="round_robin",
    )


def _backend() -> MockBackend:
    return MockBackend(
        {
            "prefill": Reply.completion("x", kv_transfer_params={"k": 1}),
            "decode": Reply.completion("hi"),
        }
    )


async def test_pairing_two_revisions_side_by_side_never_cross() -> None:
    backend = _backend()
    px = _proxy(backend)
    px.runtime.registry.apply_registry(
        [
            registered("p-old", "prefill", P_URL, "v1"),
            registered("p-new", "prefill", P2_URL, "v2"),
            registered("d-old", "decode", D_URL, "v1"),
            registered("d-new", "decode", D2_URL, "v2"),
        ]
    )
    for _ in range(8):
        ex = await px.send()
        assert ex.status == 200
    pairs = list(
        zip(
            [c.url for c in backend.calls_of("prefill")],
            [c.url for c in backend.calls_of("decode")],
            strict=True,
        )
    )
    assert len(pairs) == 8
    assert set(pairs) == {(P_URL, D_URL), (P2_URL, D2_URL)}  # both used, never crossed
    await px.settle()


def _two_revisions_v2_p_other_weights(backend: MockBackend) -> InMemoryProxy:
    """v1: a P and a D; v2: a D, and a P registered with other weights than v2's D."""
    px = _proxy(backend)
    other = KV.model_copy(update={"model": "sha256:" + "b" * 32})
    px.runtime.registry.apply_registry(
        [
            registered("p-old", "prefill", P_URL, "v1"),
            registered("p-new", "prefill", P2_URL, "v2", kv=other),
            registered("d-old", "decode", D_URL, "v1"),
            registered("d-new", "decode", D2_URL, "v2"),
        ]
    )
    return px


async def test_pairing_a_revision_with_no_prefill_left_is_served_by_d_alone() -> None:
    """v2's only P has other weights registered (or is gone): v2's D computes the prompt
    itself, counted, instead of taking v1's KV."""
    backend = _backend()
    px = _two_revisions_v2_p_other_weights(backend)
    for _ in range(4):
        assert (await px.send()).status == 200
    d_calls = [c.url for c in backend.calls_of("decode")]
    p_calls = [c.url for c in backend.calls_of("prefill")]
    assert d_calls.count(D2_URL) == 2 and p_calls == [P_URL, P_URL]
    direct = [c for c in backend.calls_of("decode") if c.url == D2_URL]
    assert all("kv_transfer_params" not in c.json() for c in direct)
    counted = [
        s.value
        for family in px.runtime.metrics.decisions.collect()
        for s in family.samples
        if s.name.endswith("_total") and s.labels["decision"] == "no_compatible_prefill"
    ]
    assert counted == [2.0]
    await px.settle()


async def test_every_pair_that_cannot_push_is_shown_and_logged_once(caplog: Any) -> None:
    """``pd_pair_unpairable`` names each registered pair that is never paired and why; the
    proxy's log says it once per pair, not once per request."""
    backend = _backend()
    px = _two_revisions_v2_p_other_weights(backend)
    with caplog.at_level(logging.WARNING, logger="pdgate.proxy"):
        for _ in range(6):
            assert (await px.send()).status == 200
    shown = {
        (s.labels["prefill"], s.labels["decode"], s.labels["reason"]): s.value
        for family in px.runtime.metrics.registry.collect()
        if family.name == "pd_pair_unpairable"
        for s in family.samples
    }
    assert shown == {
        (P_URL, D2_URL, "revision"): 1.0,
        (P2_URL, D_URL, "revision"): 1.0,
        (P2_URL, D2_URL, "identity"): 1.0,
    }
    told = [r.getMessage() for r in caplog.records if "is never paired" in r.getMessage()]
    # each D was chosen 3 times; every P it met that cannot push into it is told once
    assert sorted(told) == sorted(set(told)) and len(told) == 3, told
    assert any("weights/config differ" in t for t in told)
    await px.settle()
