"""The connector's spans (OpenTelemetry), joined to the proxy's trace.

The connector sees no HTTP headers: the proxy puts its leg span's W3C context into the leg's
``kv_transfer_params`` (``"traceparent"``, ``pdwire.params``), the scheduler half reads it with
the leg, and hands it to the worker half in the step metadata (``SendChunk.traceparent``,
``RecvEntry.traceparent``). Spans are made only for requests that carry a sampled context,
and only in an engine whose tracing is on: ``otlp_traces_endpoint`` in
``kv_connector_extra_config``, else ``$OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`` — which vLLM
itself sets from ``--otlp-traces-endpoint`` before it starts the engine core, so one flag
turns on both vLLM's and the connector's spans. The exporter follows vLLM's rule:
``$OTEL_EXPORTER_OTLP_TRACES_PROTOCOL`` ``grpc`` (the default) or ``http/protobuf``.

Each span is recorded whole once its end is known (``emit``: start, end, events with their own
times), so nothing is held open across the scheduler, writer, sender and side-channel
threads. OpenTelemetry is imported only when tracing is on.

Spans (all children of the proxy's leg span of the same engine):

* D, scheduler: ``pdgate.connector.bind`` — the binding's write (blocks allocated → the
  metaserver answered);
* D, worker: ``pdgate.connector.kv_load`` — the load (the worker sees it → finished or
  failed), with a ``done_signal_received`` event per P rank;
* P, scheduler: ``pdgate.connector.prefill`` — the request on P (first seen → finished),
  events ``push_set_up`` and ``prefill_started``, the push report as attributes;
* P, worker: ``pdgate.connector.push`` — the push (first chunk → signal sent), a
  ``chunk_pushed`` event per chunk (blocks, bytes, layers, write and exposed seconds) and
  ``done_signal_sent``; totals (bytes, push/exposed/tail seconds, hidden share).
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from pdwire.trace import TraceParent, parse_traceparent

if TYPE_CHECKING:
    from opentelemetry.sdk.trace import TracerProvider

log = logging.getLogger("pdgate.connector.tracing")

ENDPOINT_ENV = "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"
PROTOCOL_ENV = "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL"
SERVICE_NAME = "pdgate-connector"
Value = str | int | float | bool
Attributes = Mapping[str, Value]


@dataclass(frozen=True, slots=True)
class Event:
    name: str
    at: float  # wall clock, epoch seconds
    attributes: Attributes = field(default_factory=dict)


def sampled(traceparent: str | None) -> TraceParent | None:
    """The parent to record under, ``None`` when absent, malformed or not sampled."""
    tp = parse_traceparent(traceparent)
    return tp if tp is not None and tp.sampled else None


class ConnectorTracer:
    """Records finished spans on ``provider`` (thread-safe: called from any thread)."""

    def __init__(self, provider: TracerProvider) -> None:
        from opentelemetry import trace

        self._trace = trace
        self.provider = provider
        self._tracer = provider.get_tracer("pdgate.connector")

    def emit(
        self,
        name: str,
        parent: TraceParent,
        start: float,
        end: float,
        attributes: Attributes,
        events: Sequence[Event] = (),
        error: str = "",
    ) -> None:
        """One span under ``parent``, from ``start`` to ``end`` (wall clock, epoch s)."""
        t = self._trace
        ctx = t.SpanContext(parent.trace_id, parent.span_id, True, t.TraceFlags(parent.flags))
        try:
            span = self._tracer.start_span(
                name,
                context=t.set_span_in_context(t.NonRecordingSpan(ctx)),
                kind=t.SpanKind.INTERNAL,
                attributes=dict(attributes),
                start_time=_ns(start),
            )
            for ev in events:
                span.add_event(ev.name, dict(ev.attributes), timestamp=_ns(ev.at))
            if error:
                span.set_status(t.Status(t.StatusCode.ERROR, error[:500]))
            span.end(end_time=_ns(max(start, end)))
        except Exception:  # tracing must never break a transfer
            log.exception("could not record span %s", name)

    def shutdown(self) -> None:
        self.provider.shutdown()


def _ns(seconds: float) -> int:
    return int(seconds * 1e9)


def endpoint_of(configured: str, environ: Mapping[str, str] = os.environ) -> str | None:
    if environ.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return None
    return configured or environ.get(ENDPOINT_ENV) or None


def build_tracer(
    configured: str,
    resource: Attributes,
    environ: Mapping[str, str] = os.environ,
) -> ConnectorTracer | None:
    """This engine process's tracer, ``None`` when tracing is off (nothing imported)."""
    endpoint = endpoint_of(configured, environ)
    if endpoint is None:
        return None
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    protocol = environ.get(PROTOCOL_ENV, "grpc")
    exporter: Any
    if protocol == "http/protobuf":
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import (
            OTLPSpanExporter as HttpExporter,
        )

        exporter = HttpExporter(endpoint=endpoint)
    elif protocol == "grpc":
        try:
            from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import (
                OTLPSpanExporter as GrpcExporter,
            )
        except ImportError:
            log.warning(
                "%s=grpc but the OTLP gRPC exporter is not installed: connector tracing off "
                "(set %s=http/protobuf)",
                PROTOCOL_ENV,
                PROTOCOL_ENV,
            )
            return None
        exporter = GrpcExporter(endpoint=endpoint, insecure=True)
    else:
        log.warning("unsupported %s=%r: connector tracing off", PROTOCOL_ENV, protocol)
        return None
    res = Resource.create(dict(resource))
    if str(res.attributes.get("service.name", "")).startswith("unknown_service"):
        res = res.merge(Resource({"service.name": SERVICE_NAME}))
    provider = TracerProvider(resource=res)
    provider.add_span_processor(BatchSpanProcessor(exporter))
    log.info("connector tracing on: OTLP (%s) spans to %s", protocol, endpoint)
    return ConnectorTracer(provider)


def wall_offset() -> float:
    """Add to a ``perf_counter`` time to get the wall clock."""
    return time.time() - time.perf_counter()
