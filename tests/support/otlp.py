"""An OTLP/HTTP trace receiver for tests: ``POST /v1/traces`` with a protobuf
``ExportTraceServiceRequest`` (what ``opentelemetry-exporter-otlp-proto-http`` sends, gzip or
not), decoded with ``opentelemetry-proto``; answered with an ``ExportTraceServiceResponse``.
Runs on its own thread (engines in other processes post to it while the test awaits)."""

from __future__ import annotations

import gzip
import threading
import time
import zlib
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from opentelemetry.proto.common.v1.common_pb2 import AnyValue


@dataclass
class ReceivedEvent:
    name: str
    time_ns: int
    attributes: dict[str, Any]


@dataclass
class ReceivedSpan:
    service: str  # the resource's service.name
    resource: dict[str, Any]
    name: str
    trace_id: str  # 32 hex
    span_id: str  # 16 hex
    parent_span_id: str  # "" for a root
    kind: int
    start_ns: int
    end_ns: int
    status_code: int  # 0 unset, 1 ok, 2 error
    attributes: dict[str, Any]
    events: list[ReceivedEvent] = field(default_factory=list)


def _value(v: AnyValue) -> Any:
    which = v.WhichOneof("value")
    if which == "array_value":
        return [_value(x) for x in v.array_value.values]
    if which == "kvlist_value":
        return {kv.key: _value(kv.value) for kv in v.kvlist_value.values}
    return getattr(v, which) if which else None


def _attrs(kvs: Any) -> dict[str, Any]:
    return {kv.key: _value(kv.value) for kv in kvs}


def decode(body: bytes) -> list[ReceivedSpan]:
    req = ExportTraceServiceRequest()
    req.ParseFromString(body)
    out: list[ReceivedSpan] = []
    for rs in req.resource_spans:
        resource = _attrs(rs.resource.attributes)
        for ss in rs.scope_spans:
            for s in ss.spans:
                out.append(
                    ReceivedSpan(
                        service=str(resource.get("service.name", "")),
                        resource=resource,
                        name=s.name,
                        trace_id=s.trace_id.hex(),
                        span_id=s.span_id.hex(),
                        parent_span_id=s.parent_span_id.hex(),
                        kind=s.kind,
                        start_ns=s.start_time_unix_nano,
                        end_ns=s.end_time_unix_nano,
                        status_code=s.status.code,
                        attributes=_attrs(s.attributes),
                        events=[
                            ReceivedEvent(e.name, e.time_unix_nano, _attrs(e.attributes))
                            for e in s.events
                        ],
                    )
                )
    return out


class OtlpReceiver:
    def __init__(self, port: int = 0, keep: bool = True) -> None:
        """``keep``: store the spans (a benchmark's sink only counts them)."""
        self.spans: list[ReceivedSpan] = []
        self.received = 0
        self.requests = 0
        self._lock = threading.Lock()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("content-length") or 0))
                encoding = (self.headers.get("content-encoding") or "").lower()
                if encoding == "gzip":
                    body = gzip.decompress(body)
                elif encoding == "deflate":
                    body = zlib.decompress(body)
                if self.path != "/v1/traces":
                    self.send_response(404)
                    self.end_headers()
                    return
                try:
                    spans = decode(body)
                except Exception:
                    self.send_response(400)
                    self.end_headers()
                    return
                with receiver._lock:
                    if keep:
                        receiver.spans.extend(spans)
                    receiver.received += len(spans)
                    receiver.requests += 1
                answer = ExportTraceServiceResponse().SerializeToString()
                self.send_response(200)
                self.send_header("content-type", "application/x-protobuf")
                self.send_header("content-length", str(len(answer)))
                self.end_headers()
                self.wfile.write(answer)

            def do_GET(self) -> None:
                self.send_response(200 if self.path == "/health" else 404)
                self.send_header("content-length", "0")
                self.end_headers()

            def log_message(self, format: str, *args: Any) -> None:
                pass

        self._server = ThreadingHTTPServer(("127.0.0.1", port), Handler)
        self.port = int(self._server.server_address[1])
        self.url = f"http://127.0.0.1:{self.port}/v1/traces"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    def start(self) -> None:
        self._thread.start()

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(5)

    def of_trace(self, trace_id: str) -> list[ReceivedSpan]:
        with self._lock:
            return [s for s in self.spans if s.trace_id == trace_id]

    def wait(
        self, trace_id: str, done: Callable[[list[ReceivedSpan]], bool], timeout_s: float = 30.0
    ) -> list[ReceivedSpan]:
        """The trace's spans once ``done`` holds for them (or what came by the timeout)."""
        deadline = time.monotonic() + timeout_s
        while True:
            spans = self.of_trace(trace_id)
            if done(spans) or time.monotonic() > deadline:
                return spans
            time.sleep(0.1)


@contextmanager
def otlp_receiver() -> Iterator[OtlpReceiver]:
    r = OtlpReceiver()
    r.start()
    try:
        yield r
    finally:
        r.close()


def main() -> None:
    """A standalone sink (the proxy benchmark's ``--tracing``): decodes and counts spans."""
    import argparse

    ap = argparse.ArgumentParser(description="OTLP/HTTP trace sink")
    ap.add_argument("--port", type=int, default=4318)
    args = ap.parse_args()
    r = OtlpReceiver(args.port, keep=False)
    try:
        r._server.serve_forever()
    finally:
        print(f"received {r.received} spans in {r.requests} requests", flush=True)


if __name__ == "__main__":
    main()
