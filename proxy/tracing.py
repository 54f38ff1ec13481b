"""The proxy's traces (OpenTelemetry), built only when tracing is on.

The flows and the handler speak to the ``LegSpan`` / ``RequestSpan`` protocols on one path.
Off (the default) every request's span is ``NO_SPAN``, whose calls do nothing: the handler
reads no ``traceparent`` header and OpenTelemetry is never imported. On (``--otlp-traces-endpoint``,
or ``$OTEL_EXPORTER_OTLP_TRACES_ENDPOINT``), each request gets:

``pdgate.request`` (SERVER; the child of the client's ``traceparent`` when it sends a valid
one, else a new trace) with one child per leg and attempt (CLIENT):
``pdgate.decode`` (D's POST to its first byte), ``pdgate.binding_wait`` (the metaserver
long-poll) and ``pdgate.prefill`` (P's whole answer). Each engine is sent its leg span's
context, as the ``traceparent`` header (vLLM's ``llm_request`` span is its child) and in the
leg's ``kv_transfer_params`` (the connector's spans are its children, ``pdwire.params``).

Spans go through a ``BatchSpanProcessor`` (a background thread; ``OTEL_BSP_*``) to the
OTLP/HTTP exporter (``OTEL_EXPORTER_OTLP_*``); the sampler is the SDK's
(``OTEL_TRACES_SAMPLER``, parent-based by default), the resource ``service.name``
``pdgate-proxy`` unless ``OTEL_SERVICE_NAME`` / ``OTEL_RESOURCE_ATTRIBUTES`` name one.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Protocol

from pdwire.trace import format_traceparent, parse_traceparent

if TYPE_CHECKING:
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.trace import Span

    from proxy.config import ProxySettings

log = logging.getLogger("pdgate.proxy.tracing")

ENDPOINT_ENV = "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"
SERVICE_NAME = "pdgate-proxy"
Attributes = Mapping[str, str | int | float | bool]


class LegSpan(Protocol):
    """A leg's span: ``traceparent`` names it to the engine it calls (``None``: tracing off)."""

    @property
    def traceparent(self) -> str | None: ...

    @property
    def recording(self) -> bool:
        """Whether attributes are kept: a caller computes costly ones only then."""
        ...

    def set(self, key: str, value: str | int | float | bool) -> None: ...

    def event(self, name: str, attributes: Attributes | None = None) -> None: ...

    def end(self, error: BaseException | str | None = None) -> None: ...


class RequestSpan(LegSpan, Protocol):
    """A request's span; ``leg`` starts its children."""

    def leg(self, name: str, attributes: Attributes) -> LegSpan: ...


class NoSpan:
    """Every span while tracing is off: each call does nothing, no object is made."""

    __slots__ = ()
    traceparent: str | None = None
    recording = False

    def set(self, key: str, value: str | int | float | bool) -> None:
        pass

    def event(self, name: str, attributes: Attributes | None = None) -> None:
        pass

    def end(self, error: BaseException | str | None = None) -> None:
        pass

    def leg(self, name: str, attributes: Attributes) -> NoSpan:
        return self


NO_SPAN = NoSpan()


class OtelSpan:
    """One span and the ``traceparent`` that names it to the engine it calls."""

    __slots__ = ("_otel", "span", "traceparent")
    recording = True

    def __init__(self, span: Span, otel: _Otel) -> None:
        self.span = span
        self._otel = otel
        ctx = span.get_span_context()
        self.traceparent = format_traceparent(ctx.trace_id, ctx.span_id, int(ctx.trace_flags))

    def set(self, key: str, value: str | int | float | bool) -> None:
        self.span.set_attribute(key, value)

    def event(self, name: str, attributes: Attributes | None = None) -> None:
        self.span.add_event(name, attributes)

    def end(self, error: BaseException | str | None = None) -> None:
        if error is not None:
            if isinstance(error, BaseException):
                text = str(error) or type(error).__name__
                self.span.set_attribute("error.type", type(error).__name__)
            else:
                text = error
            self.span.set_status(self._otel.error_status(text))
        self.span.end()


class OtelRequestSpan(OtelSpan):
    """The request's span; ``leg`` starts its children."""

    __slots__ = ("_tracer",)

    def __init__(self, span: Span, otel: _Otel, tracer: ProxyTracer) -> None:
        super().__init__(span, otel)
        self._tracer = tracer

    def leg(self, name: str, attributes: Attributes) -> OtelSpan:
        o = self._otel
        ctx = o.set_span_in_context(self.span)
        span = self._tracer.tracer.start_span(
            f"pdgate.{name}", context=ctx, kind=o.client, attributes=attributes
        )
        return OtelSpan(span, o)


class _Otel:
    """The few OpenTelemetry names the spans use, imported once (only when tracing is on)."""

    def __init__(self) -> None:
        from opentelemetry import trace

        self.trace = trace
        self.set_span_in_context = trace.set_span_in_context
        self.server = trace.SpanKind.SERVER
        self.client = trace.SpanKind.CLIENT

    def error_status(self, text: str) -> Any:
        return self.trace.Status(self.trace.StatusCode.ERROR, text[:500])

    def remote_parent(self, value: bytes | None) -> Any:
        """The client's context as a parent, ``None`` (a new trace) when absent or invalid."""
        tp = parse_traceparent(value)
        if tp is None:
            return None
        t = self.trace
        ctx = t.SpanContext(tp.trace_id, tp.span_id, True, t.TraceFlags(tp.flags & 0xFF))
        return t.set_span_in_context(t.NonRecordingSpan(ctx))


class ProxyTracer:
    """Starts request spans on ``provider``'s tracer; ``shutdown`` flushes what is queued."""

    def __init__(self, provider: TracerProvider) -> None:
        self._otel = _Otel()
        self.provider = provider
        self.tracer = provider.get_tracer("pdgate.proxy")

    def request(self, traceparent: bytes | None, route: str, request_id: str) -> OtelRequestSpan:
        o = self._otel
        span = self.tracer.start_span(
            "pdgate.request",
            context=o.remote_parent(traceparent),
            kind=o.server,
            attributes={"http.route": route, "pdgate.request_id": request_id},
        )
        return OtelRequestSpan(span, o, self)

    def shutdown(self) -> None:
        self.provider.shutdown()


def endpoint_of(settings: ProxySettings, environ: Mapping[str, str] = os.environ) -> str | None:
    """Where traces go; ``None``: tracing is off (also with ``OTEL_SDK_DISABLED=true``)."""
    if environ.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return None
    return settings.otlp_traces_endpoint or environ.get(ENDPOINT_ENV) or None


def build_tracer(
    settings: ProxySettings, environ: Mapping[str, str] = os.environ
) -> ProxyTracer | None:
    """The OTLP/HTTP exporting tracer, or ``None`` when tracing is off (nothing imported)."""
    endpoint = endpoint_of(settings, environ)
    if endpoint is None:
        return None
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    resource = Resource.create({})
    if str(resource.attributes.get("service.name", "")).startswith("unknown_service"):
        resource = resource.merge(Resource({"service.name": SERVICE_NAME}))
    provider = TracerProvider(resource=resource)
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=endpoint)))
    log.info("tracing on: OTLP/HTTP spans to %s", endpoint)
    return ProxyTracer(provider)
