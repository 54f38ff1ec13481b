"""P refuses a decoder that cannot use its KV (another revision, other weights, another KV
shape), driven by vLLM's real Scheduler against a real metaserver. Kept out of
``test_scheduler_prefill.py``, which ``test_vllm_versions.py`` runs again on four other vLLM
releases: the comparison is pdgate's own, the same on every release."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import httpx
import pytest
from vllm.v1.core.sched.scheduler import Scheduler

from connector import stats
from pdwire.version import PROTOCOL_VERSION
from tests.connector import harness as H
from tests.connector.test_scheduler_prefill import (
    AUTH,
    D_ENDPOINT,
    _bind,
    _pushes,
    _send_params,
    _step_until_scheduled,
    make_prefiller,
)
from tests.support.services import InThreadMetaserver

__all__ = ["make_prefiller"]  # the fixture, shared with test_scheduler_prefill.py


def _p_registration(url: str, timeout_s: float = 20.0) -> dict[str, Any]:
    """P's own registration (its registrar thread writes it at start)."""
    deadline = time.monotonic() + timeout_s
    while True:
        r = httpx.get(f"{url}/v1/instances/pre-1", headers=AUTH)
        if r.status_code == 200 or time.monotonic() > deadline:
            r.raise_for_status()
            found: dict[str, Any] = r.json()
            return found
        time.sleep(0.05)


def _register_decoder_as(url: str, **fields: Any) -> None:
    body = {"role": "decode", "url": "http://127.0.0.1:8001", "kv_endpoint": D_ENDPOINT, **fields}
    httpx.put(f"{url}/v1/instances/dec-1", json=body, headers=AUTH).raise_for_status()


def _refusal(s: Scheduler, url: str, req_id: str, tid: str) -> str:
    """Why P refused a binding before its lease, as its answer says (``push: none``); P posts
    nothing on a binding it has not taken (the metaserver answers 403 to that), so the binding
    is still D's alone."""
    for _ in range(3):
        H.step(s)
    report = H.FINISHED_PARAMS[req_id]
    assert report is not None and report["push"] == "none"
    time.sleep(0.3)  # the background writer would have posted by now
    events = httpx.get(f"{url}/v1/bindings/{tid}", headers=AUTH).json()["events"]
    assert [e["state"] for e in events] == ["bound"], events
    return str(report["reason"])


def test_prefill_registers_its_kv_identity_and_revision(
    metaserver: InThreadMetaserver, make_prefiller: Callable[..., Scheduler]
) -> None:
    """What D's P compares: the weights' fingerprint and the KV cache's shape, as loaded."""
    make_prefiller(metaserver.url, revision="model-v2")
    me = _p_registration(metaserver.url)
    assert me["revision"] == "model-v2"
    kv = me["kv"]
    assert kv["model"].startswith("sha256:") and len(kv["model"]) == 7 + 32
    assert (kv["dtype"], kv["kv_cache_dtype"], kv["block_size"]) == ("float32", "float32", H.BLOCK)
    assert kv["num_kv_heads"] >= 1 and kv["num_layers"] >= 1 and kv["protocol"] == PROTOCOL_VERSION


@pytest.mark.parametrize(
    ("d_fields", "reason", "says"),
    [
        ({"revision": "model-v1"}, "revision", "revision P model-v2 vs D model-v1"),
        ({"kv": {"model": "sha256:" + "0" * 32}}, "identity", "weights/config differ"),
        ({"kv": {"num_layers": 99}}, "identity", "num_layers differ"),
    ],
    ids=["revision", "weights", "shape"],
)
def test_prefill_refuses_a_decoder_that_cannot_use_its_kv_and_says_so_once(
    metaserver: InThreadMetaserver,
    make_prefiller: Callable[..., Scheduler],
    caplog: pytest.LogCaptureFixture,
    d_fields: dict[str, Any],
    reason: str,
    says: str,
) -> None:
    """A D of another revision, or one whose registered weights or KV shape differ from P's
    (a rolling update's new checkpoint beside the old one): P pushes nothing, its answer says
    why (it posts nothing on the binding: it never took it), the refusal is counted by reason
    and logged once per D, not per request; the requests are still served (D recomputes)."""
    H.connector_stats()  # what earlier tests shipped
    s = make_prefiller(metaserver.url, revision="model-v2")
    me = _p_registration(metaserver.url)
    kv = {**me["kv"], **d_fields.get("kv", {})}
    _register_decoder_as(metaserver.url, revision=d_fields.get("revision", "model-v2"), kv=kv)
    half = H.connector_of(s).scheduler
    assert half is not None and half.prefill is not None
    for i in range(2):
        tid = f"tid-{reason}-{i}"
        b = _bind(metaserver.url, tid, 40)
        req = H.request(H.prompt(40, seed=i), _send_params(tid, b), max_tokens=1)
        s.add_request(req)
        out, meta = _step_until_scheduled(s, req.request_id)
        assert meta.sends == []
        assert says in _refusal(s, metaserver.url, req.request_id, tid)
    assert half.prefill.refused == 2
    shipped = stats.merge(H.connector_stats(), half.stats.take() or {})
    assert shipped["pairing_refusals"] == {reason: 2}
    logged = [r for r in caplog.records if "cannot use P's KV" in r.getMessage()]
    assert len([r for r in logged if r.levelname == "ERROR"]) == 1


def test_prefill_pushes_to_a_decoder_with_its_identity_and_revision(
    metaserver: InThreadMetaserver, make_prefiller: Callable[..., Scheduler]
) -> None:
    s = make_prefiller(metaserver.url, revision="model-v2")
    me = _p_registration(metaserver.url)
    _register_decoder_as(metaserver.url, revision="model-v2", kv=me["kv"])
    b = _bind(metaserver.url, "tid-same", 40)
    req = H.request(H.prompt(40), _send_params("tid-same", b), max_tokens=1)
    s.add_request(req)
    out, meta = _step_until_scheduled(s, req.request_id)
    assert _pushes(meta, req.request_id)
