"""The worker half's spans (``connector/worker/traces.py``): P's push with one event per chunk
(bytes, layers, hidden vs exposed), D's load with the done signal it received, both children
of the proxy's context handed down in the step metadata; untraced transfers make none."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import StatusCode

from connector.tracing import ConnectorTracer
from pdwire.trace import format_traceparent
from tests.connector import cluster as C

TRACE = 0x0AF7651916CD43DD8448EB211C80319C
P_SPAN, D_SPAN = 0xB7AD6B7169203331, 0x00F067AA0BA902B7


@pytest.fixture
def exporter() -> Iterator[InMemorySpanExporter]:
    exp = InMemorySpanExporter()
    yield exp
    exp.shutdown()


@pytest.fixture
def tracer(exporter: InMemorySpanExporter) -> ConnectorTracer:
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    return ConnectorTracer(provider)


def named(exporter: InMemorySpanExporter, name: str) -> list[ReadableSpan]:
    return [s for s in exporter.get_finished_spans() if s.name == name]


def test_worker_traces_push_chunks_and_load(
    exporter: InMemorySpanExporter, tracer: ConnectorTracer
) -> None:
    port = C.free_port_range(1)
    d = C.make_instance("d-eng", "kv_consumer", 1, port=port, tracer=tracer)
    p = C.make_instance("p-eng", "kv_producer", 1, tracer=tracer)
    try:
        C.fill_prefill(p)
        C.expect(d, "dreq", "tr1", [1, 2, 3], format_traceparent(TRACE, D_SPAN, 1))
        chunks = [[(0, 1)], [(1, 2), (2, 3)]]
        tp = format_traceparent(TRACE, P_SPAN, 1)
        C.push(p, "preq", "tr1", C.destination(d, port), chunks, traceparent=tp)
        C.poll(p, {"preq"}, lambda acc: "preq" in acc[0][0])
        C.poll(d, set(), lambda acc: "dreq" in acc[0][1])
    finally:
        C.close(p, d)
    (push,) = named(exporter, "pdgate.connector.push")
    assert push.context.trace_id == TRACE
    assert push.parent is not None and push.parent.span_id == P_SPAN
    assert push.status.status_code == StatusCode.UNSET
    attrs = push.attributes
    assert attrs is not None
    assert attrs["pdgate.transfer_id"] == "tr1" and attrs["pdgate.chunks"] == 2
    assert attrs["pdgate.sender"] == "p-eng/0"
    chunk_events = [e for e in push.events if e.name == "chunk_pushed"]
    assert [e.attributes["pdgate.blocks"] for e in chunk_events if e.attributes] == [1, 2]
    per_chunk = [int(str(e.attributes["pdgate.bytes"])) for e in chunk_events if e.attributes]
    assert sum(per_chunk) == attrs["pdgate.bytes"] and per_chunk[0] > 0
    assert per_chunk[1] == 2 * per_chunk[0]  # the bytes follow the blocks moved
    for e in chunk_events:
        assert e.attributes is not None
        assert e.attributes["pdgate.layers"] == len(C.LAYERS)
        write_s = e.attributes["pdgate.write_s"]
        hidden = e.attributes["pdgate.hidden_s"]
        exposed = e.attributes["pdgate.exposed_s"]
        assert isinstance(write_s, float) and isinstance(hidden, float)
        assert isinstance(exposed, float)
        assert hidden + exposed == pytest.approx(write_s)
    assert [e.name for e in push.events][-1] == "done_signal_sent"
    assert push.events[-1].attributes == {"pdgate.ok": True}
    (load,) = named(exporter, "pdgate.connector.kv_load")
    assert load.context.trace_id == TRACE
    assert load.parent is not None and load.parent.span_id == D_SPAN
    names = [e.name for e in load.events]
    assert names == ["done_signal_received", "load_finished"]
    assert load.events[0].attributes == {"pdgate.sender": "p-eng/0", "pdgate.ok": True}
    assert load.attributes is not None and load.attributes["pdgate.blocks"] == 3
    # D's load ends after P's signal went out
    assert push.end_time is not None and load.end_time is not None
    assert load.end_time >= push.events[-1].timestamp


def test_worker_traces_untraced_or_unsampled_make_no_spans(
    exporter: InMemorySpanExporter, tracer: ConnectorTracer
) -> None:
    port = C.free_port_range(1)
    d = C.make_instance("d-eng", "kv_consumer", 1, port=port, tracer=tracer)
    p = C.make_instance("p-eng", "kv_producer", 1, tracer=tracer)
    try:
        C.fill_prefill(p)
        C.expect(d, "dreq", "tr2", [1], format_traceparent(TRACE, D_SPAN, 0))  # not sampled
        C.push(p, "preq", "tr2", C.destination(d, port), [[(0, 1)]])  # no context
        C.poll(p, {"preq"}, lambda acc: "preq" in acc[0][0])
        C.poll(d, set(), lambda acc: "dreq" in acc[0][1])
    finally:
        C.close(p, d)
    assert exporter.get_finished_spans() == ()


def test_worker_traces_failed_load_is_an_error(
    exporter: InMemorySpanExporter, tracer: ConnectorTracer
) -> None:
    port = C.free_port_range(1)
    d = C.make_instance("d-eng", "kv_consumer", 1, port=port, tracer=tracer)
    p = C.make_instance("p-eng", "kv_producer", 1, tracer=tracer)
    try:
        C.fill_prefill(p)
        C.expect(d, "dreq", "tr3", [1, 2], format_traceparent(TRACE, D_SPAN, 1))
        tp = format_traceparent(TRACE, P_SPAN, 1)
        dest = C.destination(d, port)
        C.push(p, "preq", "tr3", dest, [[(0, 1)]], fail_last="prefill preempted", traceparent=tp)
        C.poll(p, {"preq"}, lambda acc: "preq" in acc[0][0])
        C.poll(d, set(), lambda acc: "dreq" in acc[0][2])
    finally:
        C.close(p, d)
    (push,) = named(exporter, "pdgate.connector.push")
    assert push.status.status_code == StatusCode.ERROR
    assert push.status.description == "prefill preempted"
    (load,) = named(exporter, "pdgate.connector.kv_load")
    assert load.status.status_code == StatusCode.ERROR
    assert [e.name for e in load.events] == ["done_signal_received", "load_failed"]
