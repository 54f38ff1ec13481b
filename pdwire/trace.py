"""The W3C ``traceparent`` as pdgate carries it: one parser, one formatter, no OpenTelemetry.

The proxy reads a client's ``traceparent`` header with ``parse_traceparent`` and sends each
engine the context of its leg's span, as the ``traceparent`` HTTP header (vLLM's own request
span joins the trace from it) and inside the leg's ``kv_transfer_params`` (the connector's
spans join from there: the connector sees no HTTP headers). A malformed value is ignored,
never an error: tracing must not fail a request.

Format (https://www.w3.org/TR/trace-context/#traceparent-header):
``00-<32 hex trace id>-<16 hex parent span id>-<2 hex flags>``; neither id all zeros.
"""

from __future__ import annotations

from dataclasses import dataclass

TRACEPARENT = "traceparent"  # the HTTP header and the kv_transfer_params key
_HEX = frozenset("0123456789abcdef")
SAMPLED = 0x01


@dataclass(frozen=True, slots=True)
class TraceParent:
    trace_id: int
    span_id: int
    flags: int

    @property
    def sampled(self) -> bool:
        return bool(self.flags & SAMPLED)

    def header(self) -> str:
        return format_traceparent(self.trace_id, self.span_id, self.flags)


def format_traceparent(trace_id: int, span_id: int, flags: int) -> str:
    return f"00-{trace_id:032x}-{span_id:016x}-{flags:02x}"


def parse_traceparent(value: str | bytes | None) -> TraceParent | None:
    """The context of a ``traceparent`` value, ``None`` when absent or malformed. A version
    above 00 is read by its first four fields, as the specification asks."""
    if value is None:
        return None
    if isinstance(value, bytes):
        value = value.decode("latin-1")
    value = value.strip()
    if len(value) < 55 or (len(value) > 55 and value[55] != "-"):
        return None
    version, trace, span, flags = value[:2], value[3:35], value[36:52], value[53:55]
    if value[2] != "-" or value[35] != "-" or value[52] != "-":
        return None
    if not _HEX.issuperset(version + trace + span + flags) or version == "ff":
        return None
    if version == "00" and len(value) != 55:
        return None
    trace_id, span_id = int(trace, 16), int(span, 16)
    if not trace_id or not span_id:
        return None
    return TraceParent(trace_id, span_id, int(flags, 16))
