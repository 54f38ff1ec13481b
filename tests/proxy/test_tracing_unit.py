"""The proxy's spans through ``tests.proxy.mock`` and the SDK's ``InMemorySpanExporter``: their
tree, what each engine is sent (header and ``kv_transfer_params``), continuing a client's trace,
failures, and tracing off (no header, no params key, no OpenTelemetry imported)."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode

from pdwire.trace import format_traceparent, parse_traceparent
from proxy.config import Flow, ProxySettings
from proxy.tracing import ProxyTracer, build_tracer
from tests.proxy.inmemory import BINDING, D_URL, MS_URL, P_URL, PUSHED, SSE, InMemoryProxy, never
from tests.proxy.mock import MockBackend, Reply
from tests.support.otlp import otlp_receiver

ROOT = Path(__file__).resolve().parents[2]
CLIENT_TRACE = 0x4BF92F3577B34DA6A3CE929D0E0E4736
CLIENT_SPAN = 0x00F067AA0BA902B7


@pytest.fixture
def spans() -> Iterator[InMemorySpanExporter]:
    exporter = InMemorySpanExporter()
    yield exporter
    exporter.shutdown()


def traced(
    backend: MockBackend, exporter: InMemorySpanExporter, **settings: object
) -> InMemoryProxy:
    px = InMemoryProxy(backend, **settings)  # type: ignore[arg-type]
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    px.runtime.tracer = ProxyTracer(provider)
    return px


def by_name(exporter: InMemorySpanExporter) -> dict[str, ReadableSpan]:
    out: dict[str, ReadableSpan] = {}
    for s in exporter.get_finished_spans():
        assert s.name not in out, f"two {s.name} spans"
        out[s.name] = s
    return out


def ids(span: ReadableSpan) -> str:
    ctx = span.get_span_context()
    assert ctx is not None
    return format_traceparent(ctx.trace_id, ctx.span_id, int(ctx.trace_flags))


async def test_tracing_decode_first_spans_and_propagation(
    spans: InMemorySpanExporter,
) -> None:
    backend = MockBackend({"decode": SSE, "get": Reply.json(BINDING), "prefill": PUSHED})
    px = traced(backend, spans)
    ex = await px.send(stream=True)
    assert ex.status == 200
    await px.settle()
    got = by_name(spans)
    assert set(got) == {
        "pdgate.request",
        "pdgate.decode",
        "pdgate.binding_wait",
        "pdgate.prefill",
    }
    root = got["pdgate.request"]
    assert root.parent is None and root.kind == SpanKind.SERVER
    assert root.attributes is not None
    assert root.attributes["pdgate.outcome"] == "ok"
    assert root.attributes["http.response.status_code"] == 200
    assert root.attributes["pdgate.flow"] == "decode-first"
    assert root.attributes["pdgate.decode"] == D_URL
    trace_id = root.context.trace_id
    (d,) = backend.calls_of("decode")
    (p,) = backend.calls_of("prefill")
    for name in ("pdgate.decode", "pdgate.binding_wait", "pdgate.prefill"):
        child = got[name]
        assert child.context.trace_id == trace_id
        assert child.parent is not None and child.parent.span_id == root.context.span_id
        assert child.attributes is not None
        assert child.attributes["pdgate.transfer_id"] == d.transfer_id
    # each engine is sent its own leg's span: header and kv_transfer_params alike
    assert d.traceparent == ids(got["pdgate.decode"])
    assert d.json()["kv_transfer_params"]["traceparent"] == d.traceparent
    assert p.traceparent == ids(got["pdgate.prefill"])
    assert p.json()["kv_transfer_params"]["traceparent"] == p.traceparent
    assert got["pdgate.prefill"].attributes == {
        "pdgate.transfer_id": d.transfer_id,
        "server.address": P_URL,
        "pdgate.push": "started",
    }
    # the request span ends with the stream, D's leg at its first byte
    assert root.end_time is not None and got["pdgate.decode"].end_time is not None
    assert root.end_time >= got["pdgate.decode"].end_time


async def test_tracing_continues_the_client_traceparent(spans: InMemorySpanExporter) -> None:
    backend = MockBackend({"decode": SSE, "get": Reply.json(BINDING), "prefill": PUSHED})
    px = traced(backend, spans)
    header = format_traceparent(CLIENT_TRACE, CLIENT_SPAN, 1).encode()
    ex = await px.request(stream=True, headers=[(b"traceparent", header)]).done()
    assert ex.status == 200
    await px.settle()
    root = by_name(spans)["pdgate.request"]
    assert root.context.trace_id == CLIENT_TRACE
    assert root.parent is not None and root.parent.span_id == CLIENT_SPAN
    assert root.parent.is_remote
    (d,) = backend.calls_of("decode")
    sent = parse_traceparent(d.traceparent)
    assert sent is not None and sent.trace_id == CLIENT_TRACE and sent.sampled


async def test_tracing_malformed_client_traceparent_starts_a_new_trace(
    spans: InMemorySpanExporter,
) -> None:
    backend = MockBackend({"decode": SSE, "get": Reply.json(BINDING), "prefill": PUSHED})
    px = traced(backend, spans)
    bad = b"00-00000000000000000000000000000000-00f067aa0ba902b7-01"  # all-zero trace id
    ex = await px.request(stream=True, headers=[(b"traceparent", bad)]).done()
    assert ex.status == 200
    await px.settle()
    root = by_name(spans)["pdgate.request"]
    assert root.parent is None and root.context.trace_id != 0


async def test_tracing_unsampled_client_trace_records_nothing(
    spans: InMemorySpanExporter,
) -> None:
    """The SDK's default sampler follows the parent: the engines are told "not sampled"."""
    backend = MockBackend({"decode": SSE, "get": Reply.json(BINDING), "prefill": PUSHED})
    px = traced(backend, spans)
    header = format_traceparent(CLIENT_TRACE, CLIENT_SPAN, 0).encode()
    ex = await px.request(stream=True, headers=[(b"traceparent", header)]).done()
    assert ex.status == 200
    await px.settle()
    assert spans.get_finished_spans() == ()
    (d,) = backend.calls_of("decode")
    sent = parse_traceparent(d.traceparent)
    assert sent is not None and sent.trace_id == CLIENT_TRACE and not sent.sampled


async def test_tracing_failed_attempt_and_retry(spans: InMemorySpanExporter) -> None:
    backend = MockBackend(
        {"decode": [Reply.fail("D died"), SSE], "get": Reply.json(BINDING), "prefill": PUSHED}
    )
    px = traced(backend, spans, retries=1)
    ex = await px.send(stream=True)
    assert ex.status == 200
    await px.settle()
    finished = spans.get_finished_spans()
    decodes = [s for s in finished if s.name == "pdgate.decode"]
    assert [s.status.status_code for s in decodes] == [StatusCode.ERROR, StatusCode.UNSET]
    assert decodes[0].status.description is not None
    assert "D died" in decodes[0].status.description
    (root,) = [s for s in finished if s.name == "pdgate.request"]
    (event,) = root.events
    assert event.name == "attempt_failed"
    assert event.attributes is not None and event.attributes["pdgate.leg"] == "decode"
    first, second = backend.calls_of("decode")
    assert first.traceparent != second.traceparent  # one span per attempt
    assert root.status.status_code == StatusCode.UNSET


async def test_tracing_request_that_fails_is_an_error(spans: InMemorySpanExporter) -> None:
    backend = MockBackend(
        {"decode": SSE.after(never()), "get": Reply.json(BINDING), "prefill": Reply.fail()}
    )
    px = traced(backend, spans)
    ex = await px.send(stream=True)
    assert ex.status == 502
    await px.settle()
    got = by_name(spans)
    assert got["pdgate.prefill"].status.status_code == StatusCode.ERROR
    root = got["pdgate.request"]
    assert root.status.status_code == StatusCode.ERROR
    assert root.attributes is not None and root.attributes["http.response.status_code"] == 502
    # D's leg, still waiting, was dropped when P failed: its span ends too, as cancelled
    d_span = got["pdgate.decode"]
    assert d_span.status.status_code == StatusCode.ERROR
    assert d_span.attributes is not None
    assert d_span.attributes["error.type"] == "CancelledError"


async def test_tracing_direct_flow_has_one_leg(spans: InMemorySpanExporter) -> None:
    backend = MockBackend({"decode": SSE})
    px = traced(backend, spans, flow=Flow.DIRECT)
    ex = await px.send(stream=True)
    assert ex.status == 200
    await px.settle()
    got = by_name(spans)
    assert set(got) == {"pdgate.request", "pdgate.decode"}
    (d,) = backend.calls_of("decode")
    assert d.traceparent == ids(got["pdgate.decode"])
    assert "kv_transfer_params" not in d.json()


async def test_tracing_off_sends_no_trace_context() -> None:
    backend = MockBackend({"decode": SSE, "get": Reply.json(BINDING), "prefill": PUSHED})
    px = InMemoryProxy(backend)
    assert px.runtime.tracer is None
    header = format_traceparent(CLIENT_TRACE, CLIENT_SPAN, 1).encode()
    ex = await px.request(stream=True, headers=[(b"traceparent", header)]).done()
    assert ex.status == 200
    await px.settle()
    for call in backend.calls_of("decode") + backend.calls_of("prefill"):
        assert call.traceparent is None
        assert "traceparent" not in call.json()["kv_transfer_params"]


def test_tracing_endpoint_from_flag_env_or_off() -> None:
    base = {"prefill": [P_URL], "decode": [D_URL], "metaserver": MS_URL}
    off = ProxySettings(**base)  # type: ignore[arg-type]
    assert build_tracer(off, {}) is None
    env = {"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://127.0.0.1:1/v1/traces"}
    tracer = build_tracer(off, env)
    assert tracer is not None
    resource = tracer.provider.resource.attributes
    assert resource["service.name"] == "pdgate-proxy"
    tracer.shutdown()
    flagged = ProxySettings(**base, otlp_traces_endpoint="http://127.0.0.1:1/v1/traces")  # type: ignore[arg-type]
    assert build_tracer(flagged, {"OTEL_SDK_DISABLED": "true"}) is None


def test_tracing_off_imports_no_opentelemetry() -> None:
    """With tracing off, building and wiring the proxy loads no OpenTelemetry module."""
    code = (
        "import sys; from proxy import ProxySettings, create_app; "
        "from proxy.tracing import build_tracer; "
        "s = ProxySettings(prefill=['http://p:1'], decode=['http://d:1'], "
        "metaserver='http://m:1'); app = create_app(s); "
        "assert build_tracer(s, {}) is None; "
        "print(sorted(m for m in sys.modules if m.startswith('opentelemetry')))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True
    )
    assert out.stdout.strip() == "[]", out.stdout


def test_tracing_exports_otlp_http_protobuf_to_a_receiver(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The real exporter path: ``build_tracer`` → BatchSpanProcessor → OTLP/HTTP protobuf,
    decoded by the test receiver (``opentelemetry-proto``)."""
    base = {"prefill": [P_URL], "decode": [D_URL], "metaserver": MS_URL}
    with otlp_receiver() as receiver:
        settings = ProxySettings(**base, otlp_traces_endpoint=receiver.url)  # type: ignore[arg-type]
        monkeypatch.setenv("OTEL_SERVICE_NAME", "px-under-test")  # the SDK's own variable
        tracer = build_tracer(settings, {})
        assert tracer is not None
        header = format_traceparent(CLIENT_TRACE, CLIENT_SPAN, 1).encode()
        root = tracer.request(header, "/v1/completions", "req-1")
        leg = root.leg("decode", {"pdgate.transfer_id": "pd-1"})
        leg.end()
        root.end("boom")
        tracer.shutdown()  # flushes
        spans = receiver.of_trace(f"{CLIENT_TRACE:032x}")
    assert sorted(s.name for s in spans) == ["pdgate.decode", "pdgate.request"]
    got = {s.name: s for s in spans}
    assert got["pdgate.request"].service == "px-under-test"
    assert got["pdgate.request"].parent_span_id == f"{CLIENT_SPAN:016x}"
    assert got["pdgate.request"].status_code == 2  # error
    assert got["pdgate.decode"].parent_span_id == got["pdgate.request"].span_id
    assert got["pdgate.decode"].attributes == {"pdgate.transfer_id": "pd-1"}
    assert leg.traceparent == format_traceparent(
        CLIENT_TRACE, int(got["pdgate.decode"].span_id, 16), 1
    )
