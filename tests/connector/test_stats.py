"""The connector's metrics: the delta dicts vLLM merges, the Prometheus series they feed, and
what real worker halves count for a push (bytes on P == bytes on D == blocks x block bytes)."""

from __future__ import annotations

import threading
from functools import partial
from types import SimpleNamespace
from typing import Any, cast

import msgspec
import pytest
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from connector import stats, wire
from connector.connector import PdgateConnector
from connector.prom import PdgatePromMetrics, PdgateStats
from connector.stats import StatsCollector
from connector.worker.receiver import NO_PREFILL, UNKNOWN_PREFILL, RecvTracker, Source
from tests.connector import cluster as C
from tests.connector.test_worker_failures import FakeClock, _sig
from tests.connector.test_worker_retry import PAIRS, FailsOnce


# ---- the delta dicts ------------------------------------------------------------------------
def test_stats_merge_adds_counters_labels_and_gauge_deltas_and_joins_observations() -> None:
    a: stats.StatsData = {
        "push_bytes": 100,
        "handshakes": {"ok": 1},
        "push_seconds": [0.5],
        "blocks_held": {"prefill": 4},
    }
    b = {
        "push_bytes": 28,
        "handshakes": {"ok": 2, "failed": 1},
        "push_seconds": [0.25],
        "blocks_held": {"prefill": -4, "decode": 3},
    }
    assert stats.merge(a, b) is a
    assert a == {
        "push_bytes": 128,
        "handshakes": {"ok": 3, "failed": 1},
        "push_seconds": [0.5, 0.25],
        "blocks_held": {"prefill": 0, "decode": 3},
    }


def test_stats_empty_means_only_zeros() -> None:
    assert stats.is_empty({})
    assert stats.is_empty({"push_bytes": 0, "push_seconds": [], "blocks_held": {"decode": 0}})
    assert not stats.is_empty({"blocks_held": {"decode": -2}})  # a gauge going down is news
    assert not stats.is_empty({"push_seconds": [0.0]})


def test_stats_collector_take_hands_over_and_resets() -> None:
    c = StatsCollector()
    assert c.take() is None
    c.add("push_bytes", 10)
    c.add("load_failures", label="timeout")
    c.observe("push_seconds", 0.1)
    assert c.take() == {
        "push_bytes": 10,
        "load_failures": {"timeout": 1},
        "push_seconds": [0.1],
    }
    assert c.take() is None
    c.add("blocks_held", 2, label="decode")
    c.add("blocks_held", -2, label="decode")
    assert c.take() is None  # no net change: nothing to report


def test_stats_collector_loses_nothing_across_threads() -> None:
    c = StatsCollector()
    taken: list[stats.StatsData] = []

    def count() -> None:
        for _ in range(2000):
            c.add("push_pieces")

    threads = [threading.Thread(target=count) for _ in range(4)]
    for t in threads:
        t.start()
    while any(t.is_alive() for t in threads):
        if (d := c.take()) is not None:
            taken.append(d)
    for t in threads:
        t.join()
    if (d := c.take()) is not None:
        taken.append(d)
    assert sum(d["push_pieces"] for d in taken) == 8000


def test_stats_reduce_summarises_an_interval_for_the_log_line() -> None:
    out = stats.reduce(
        {"push_bytes": 64, "load_failures": {"timeout": 2, "corrupt": 0}, "push_seconds": [1, 3]}
    )
    assert out == {
        "push_bytes": 64,
        "load_failures[timeout]": 2,
        "push_seconds_count": 2,
        "push_seconds_avg_ms": 2000.0,
    }


def test_stats_series_names_are_prefixed_and_unique() -> None:
    names = [s.name for s in stats.SERIES]
    assert len(set(names)) == len(names)
    assert all(n.startswith("vllm:pdgate_") for n in names)
    assert "vllm:pdgate_push_bytes_total" in stats.exposed_names()
    assert "vllm:pdgate_push_seconds_bucket" in stats.exposed_names()
    assert "vllm:pdgate_blocks_held" in stats.exposed_names()


# ---- vLLM's objects -----------------------------------------------------------------------
def test_stats_object_aggregates_resets_and_is_rebuilt_from_its_dict() -> None:
    worker0 = PdgateStats(data={"push_bytes": 10, "transfers": {"ok": 1}})
    worker1 = PdgateStats(data={"push_bytes": 5, "transfers": {"failed": 1}})
    merged = worker0.aggregate(worker1)
    assert merged.to_dict() == {"push_bytes": 15, "transfers": {"ok": 1, "failed": 1}}
    # the API process rebuilds it from the dict vLLM shipped (msgpack: plain dicts and lists)
    rebuilt = PdgateConnector.build_kv_connector_stats(merged.to_dict())
    assert isinstance(rebuilt, PdgateStats) and rebuilt.to_dict() == merged.to_dict()
    assert rebuilt.reduce()["transfers[failed]"] == 1
    empty = PdgateConnector.build_kv_connector_stats(None)
    assert empty.is_empty()
    merged.reset()
    assert merged.is_empty() and merged.to_dict() == {}


def _prom(registry: CollectorRegistry) -> PdgatePromMetrics:
    """Built the way vLLM's ``KVConnectorProm`` builds it (``kv_connector/v1/metrics.py``),
    with metric classes bound to a private registry."""
    types: Any = {cls: partial(cls, registry=registry) for cls in (Gauge, Counter, Histogram)}
    config = cast(Any, SimpleNamespace(kv_transfer_config=None))
    return PdgatePromMetrics(config, types, ["model_name", "engine"], {0: ["tiny", "0"]})


def test_stats_prom_series_exist_at_zero_and_add_each_delta() -> None:
    registry = CollectorRegistry()
    prom = _prom(registry)
    at = {"model_name": "tiny", "engine": "0"}
    val = registry.get_sample_value
    assert val("vllm:pdgate_push_bytes_total", at) == 0
    assert val("vllm:pdgate_load_failures_total", {**at, "cause": "timeout"}) == 0
    assert val("vllm:pdgate_blocks_held", {**at, "side": "decode"}) == 0
    prom.observe({"push_bytes": 4096, "push_seconds": [0.002, 0.2], "handshakes": {"ok": 1}})
    prom.observe({"push_bytes": 1024, "blocks_held": {"decode": 3}})
    prom.observe({"blocks_held": {"decode": -1}, "load_failures": {"corrupt": 1}})
    prom.observe({"a_series_from_a_newer_worker": 1})
    assert val("vllm:pdgate_push_bytes_total", at) == 5120
    assert val("vllm:pdgate_push_seconds_count", at) == 2
    assert val("vllm:pdgate_push_seconds_sum", at) == pytest.approx(0.202)
    assert val("vllm:pdgate_handshakes_total", {**at, "result": "ok"}) == 1
    assert val("vllm:pdgate_blocks_held", {**at, "side": "decode"}) == 2
    assert val("vllm:pdgate_load_failures_total", {**at, "cause": "corrupt"}) == 1
    exposed = {s.name for m in registry.collect() for s in m.samples}
    # a series labelled by values known only when they come (the P instance) appears with them
    later = {n for s in stats.SERIES if s.label and not s.values for n in s.exposed}
    assert later == {"vllm:pdgate_blocks_pushed_total", "vllm:pdgate_blocks_recomputed_total"}
    assert stats.exposed_names() - later <= exposed and not later & exposed
    prom.observe({"blocks_pushed": {"pd-prefill-0": 6}, "blocks_recomputed": {"none": 2}})
    assert val("vllm:pdgate_blocks_pushed_total", {**at, "prefill": "pd-prefill-0"}) == 6
    assert val("vllm:pdgate_blocks_recomputed_total", {**at, "prefill": "none"}) == 2


# ---- what the worker halves count ---------------------------------------------------------
def test_stats_push_bytes_on_p_equal_bytes_received_on_d() -> None:
    port = C.free_port_range(1)
    d = C.make_instance("d-eng", "kv_consumer", 1, port=port)
    p = C.make_instance("p-eng", "kv_producer", 1)
    try:
        C.fill_prefill(p, seed=3)
        C.expect(d, "dreq", "tstats", [b for _, b in PAIRS])
        C.push(p, "preq", "tstats", C.destination(d, port), [PAIRS[:2], PAIRS[2:]])
        C.poll(d, set(), lambda acc: "dreq" in acc[0][1])
        C.poll(p, {"preq"}, lambda acc: "preq" in acc[0][0])
        sent = p.workers[0].stats.take()
        got = d.workers[0].stats.take()
        assert sent is not None and got is not None
        memory = d.workers[0].memory
        assert memory is not None
        whole = len(PAIRS) * memory.bytes_per_block  # 3 blocks x 4 layers x 8 heads x ...
        assert whole == 3 * 4 * 8 * 16 * 2 * 32 * 4
        assert sent["push_bytes"] == whole == got["recv_bytes"]
        assert got["recv_blocks"] == 3 and got["loads"] == 1
        assert got["blocks_pushed"] == {p.workers[0].actor: 3}  # named by P's done signal
        assert sent["transfers"] == {"ok": 1} and sent["handshakes"] == {"ok": 1}
        assert sent["push_pieces"] >= 4 and sent["push_writes"] >= 1
        assert len(sent["push_seconds"]) == 1 == len(sent["push_exposed_seconds"])
        assert 0 <= sent["push_exposed_seconds"][0] <= sent["push_seconds"][0]
        assert "load_failures" not in got and "write_retries" not in sent
    finally:
        C.close(p, d)


@pytest.mark.parametrize("retries", [1, 0])
def test_stats_failed_write_counts_retry_holds_and_failures(
    monkeypatch: pytest.MonkeyPatch, retries: int
) -> None:
    monkeypatch.setenv("PDGATE_CONNECTOR_WRITE_RETRIES", str(retries))
    port = C.free_port_range(1)
    d = C.make_instance("d-eng", "kv_consumer", 1, port=port)
    p = C.make_instance("p-eng", "kv_producer", 1, transports=[FailsOnce()])
    d.workers[0].recompute = True
    try:
        C.fill_prefill(p, seed=5)
        C.expect(d, "dreq", "tfail", [b for _, b in PAIRS])
        C.push(p, "preq", "tfail", C.destination(d, port), [PAIRS[:2], PAIRS[2:]])
        C.poll(d, set(), lambda acc: "dreq" in acc[0][1])
        C.poll(p, {"preq"}, lambda acc: "preq" in acc[0][0])
        sent, got = p.workers[0].stats.take(), d.workers[0].stats.take()
        assert sent is not None and got is not None
        assert got["late_landing_holds"] == {"decode": 1}
        if retries:  # P holds its blocks only when D may decode from the ones it wrote
            assert sent["late_landing_holds"] == {"prefill": 1}
            assert sent["write_retries"] == 1 and "write_failures" not in sent
            assert sent["transfers"] == {"ok": 1} and got["loads"] == 1
            assert "recomputes" not in got and "blocks_recomputed" not in got
            assert got["blocks_pushed"] == {p.workers[0].actor: 3}
        else:
            assert sent["write_failures"] == 1 and "write_retries" not in sent
            assert "late_landing_holds" not in sent
            assert sent["transfers"] == {"failed": 1} and "push_seconds" not in sent
            assert got["load_failures"] == {"prefill_failed": 1} and got["recomputes"] == 1
            assert "recv_bytes" not in got and "blocks_pushed" not in got
            assert got["blocks_recomputed"] == {p.workers[0].actor: 3}
    finally:
        C.close(p, d)


def test_stats_load_failures_by_cause() -> None:
    clock = FakeClock()
    t = RecvTracker(5.0, clock)
    t.expect("silent", "t1")
    t.expect("refused", "t2")
    t.expect("p-failed", "t3")
    t.expect("aborted", "t4")
    t.fail("refused")
    t.on_signal(_sig("t3", "p/0", ok=False))
    t.aborted({"aborted"})
    assert t.poll() == ({"refused", "p-failed"}, {"refused", "p-failed"})
    clock.now += 6
    assert t.poll() == ({"silent", "aborted"}, {"silent"})
    assert t.stats.take() == {
        "load_failures": {"binding_rejected": 1, "prefill_failed": 1, "timeout": 1}
    }


def test_stats_sources_name_the_prefill_instance_of_each_load() -> None:
    clock = FakeClock()
    t = RecvTracker(5.0, clock)
    for req in ("named", "older-p", "silent", "aborted"):
        t.expect(req, f"t-{req}")
    t.on_signal(wire.Signal("t-named", "e1/0", True, 1, instance="pd-prefill-0"))
    t.on_signal(wire.Signal("t-older-p", "e2/0", True, 1))  # a P that does not name itself
    t.aborted({"aborted"})
    t.poll()
    clock.now += 6
    t.poll()
    assert t.take_sources() == {
        "named": Source("pd-prefill-0", True),
        "older-p": Source(UNKNOWN_PREFILL, True),
        "silent": Source(NO_PREFILL, False),
    }  # an aborted load is nobody's
    assert t.take_sources() == {}


def test_signal_instance_must_be_a_label_value() -> None:
    ok = wire.Signal("t", "e/0", True, 1, instance="pd-prefill-0.ns:8000")
    assert wire.decode(wire.encode(ok)) == ok
    bad = msgspec.msgpack.encode(
        {"type": "signal", "transfer_id": "t", "sender": "e/0", "ok": True, "expected": 1,
         "instance": 'x"} 1\n'}
    )  # fmt: skip
    with pytest.raises(msgspec.ValidationError):
        wire.decode(bad)


def test_stats_late_arrival_and_corrupt_load_are_counted() -> None:
    clock = FakeClock()
    t = RecvTracker(60.0, clock, landing_wait_s=5.0)
    answers = {"late": iter(["crc mismatch", ""]), "bad": iter(["crc mismatch"] * 3)}
    t.verify = lambda sig: next(answers[sig.transfer_id])
    for name in answers:
        t.expect(name, name)
        t.on_signal(wire.Signal(name, "p/0", True, 1, "", [(0, 0, 64, 1)]))
    assert t.poll() == (set(), set())  # digests do not match yet: keep waiting
    clock.now += 1
    assert t.poll() == ({"late"}, set())  # its KV landed after the done signal
    clock.now += 5
    assert t.poll() == ({"bad"}, {"bad"})  # still wrong after landing_wait_s
    assert t.stats.take() == {"loads": 1, "late_arrivals": 1, "load_failures": {"corrupt": 1}}
