"""The proxy's lock-free metrics render as the Prometheus text format expects."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from proxy.metrics import InFlight, Metrics


def _samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def test_metrics_counters_gauges_histograms_render() -> None:
    m = Metrics(list)
    m.requests.labels("chat", "decode-first", "ok", "200").inc()
    m.requests.labels("chat", "decode-first", "ok", "200").inc()
    m.retries.labels(reason="upstream_error").inc()
    m.inflight.inc()
    m.inflight.inc()
    m.inflight.dec()
    for value in (0.0005, 0.003, 0.003, 100.0):
        m.total_seconds.labels("direct").observe(value)
    m.prefill_seconds.observe(0.01)
    got = _samples(m.render().decode())

    key = (("endpoint", "chat"), ("flow", "decode-first"), ("outcome", "ok"), ("status", "200"))
    assert got[("pd_requests_total", key)] == 2
    assert got[("pd_retries_total", (("reason", "upstream_error"),))] == 1
    assert got[("pd_inflight", ())] == 1
    flow = (("flow", "direct"),)
    assert got[("pd_request_seconds_bucket", (*flow, ("le", "0.001")))] == 1
    assert got[("pd_request_seconds_bucket", (*flow, ("le", "0.0025")))] == 1
    assert got[("pd_request_seconds_bucket", (*flow, ("le", "0.005")))] == 3
    assert got[("pd_request_seconds_bucket", (*flow, ("le", "60.0")))] == 3
    assert got[("pd_request_seconds_bucket", (*flow, ("le", "+Inf")))] == 4
    assert got[("pd_request_seconds_count", flow)] == 4
    assert abs(got[("pd_request_seconds_sum", flow)] - 100.0065) < 1e-9
    assert got[("pd_prefill_seconds_bucket", (("le", "0.01"),))] == 1  # le is inclusive
    assert got[("pd_prefill_seconds_count", ())] == 1


def test_metrics_in_flight_counts_and_ages_the_oldest() -> None:
    now = [100.0]
    registry = CollectorRegistry()
    waits = InFlight(
        "w", "waiting", "w_oldest_seconds", "age", registry=registry, clock=lambda: now[0]
    )
    assert (len(waits), waits.oldest_age()) == (0, 0.0)
    first = waits.start()
    now[0] = 101.0
    second = waits.start()
    now[0] = 103.5
    got = _samples(generate_latest(registry).decode())
    assert got[("w", ())] == 2 and got[("w_oldest_seconds", ())] == 3.5
    waits.end(first)
    assert waits.oldest_age() == 2.5  # the second is the oldest now
    waits.end(second)
    waits.end(second)  # ending twice is harmless
    got = _samples(generate_latest(registry).decode())
    assert got[("w", ())] == 0 and got[("w_oldest_seconds", ())] == 0


def test_metrics_proxy_exports_the_autoscaling_signals_from_the_start() -> None:
    got = _samples(Metrics(list).render().decode())
    for name in ("pd_binding_waits", "pd_binding_wait_oldest_seconds", "pd_transfers_inflight",
                 "pd_transfer_oldest_age_seconds"):  # fmt: skip
        assert got[(name, ())] == 0
