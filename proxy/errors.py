"""The proxy's exception tree; ``proxy.app`` turns any of them into one OpenAI-style answer.

ProxyError                    500 internal_error
├── BadRequest                400 invalid_request_error (malformed JSON, wrong types)
├── PayloadTooLarge           413 invalid_request_error (body above --max-body-bytes)
├── RequestTimeout            408 invalid_request_error (body slower than --receipt-timeout)
├── Unauthorized              401 authentication_error
├── NotFound                  404 not_found_error (admin call: no such instance)
├── Overloaded                429 rate_limit_error (admission limit; carries Retry-After)
├── NoInstance                503 service_unavailable (no healthy instance in a pool)
├── MetaserverDown            503 service_unavailable (admin call: metaserver unreachable)
└── UpstreamError             502 upstream_error (retryable: connect error, 5xx, broken body)
    ├── UpstreamTimeout       504 (a leg ran past its timeout)
    ├── BindingTimeout        504 (D never wrote the binding)
    ├── MetaserverUnavailable 502 (no answer or a 5xx while reading a binding)
    └── UpstreamRejected      the backend's own 4xx, passed through; never retried
"""

from __future__ import annotations

from typing import Annotated, Any

import msgspec


class ProxyError(Exception):
    status = 500
    kind = "internal_error"
    retryable = False

    def __init__(self, message: str, *, retry_after: float | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.retry_after = retry_after

    @property
    def public(self) -> str:
        """What a client may read. ``message`` (logs and traces) may name internal addresses;
        the errors that can override this."""
        return self.message

    def body(self) -> bytes:
        return error_json(self.public, self.kind, self.status)


class BadRequest(ProxyError):
    status = 400
    kind = "invalid_request_error"


class PayloadTooLarge(ProxyError):
    status = 413
    kind = "invalid_request_error"


class RequestTimeout(ProxyError):
    status = 408
    kind = "invalid_request_error"


class Unauthorized(ProxyError):
    status = 401
    kind = "authentication_error"


class Forbidden(ProxyError):
    status = 403
    kind = "permission_error"


class NotFound(ProxyError):
    status = 404
    kind = "not_found_error"


class Overloaded(ProxyError):
    status = 429
    kind = "rate_limit_error"


class NoInstance(ProxyError):
    status = 503
    kind = "service_unavailable"


class MetaserverDown(ProxyError):
    status = 503
    kind = "service_unavailable"


class UpstreamError(ProxyError):
    status = 502
    kind = "upstream_error"
    retryable = True


class UpstreamTimeout(UpstreamError):
    status = 504
    kind = "upstream_timeout"


class BindingTimeout(UpstreamTimeout):
    kind = "binding_timeout"


class MetaserverUnavailable(UpstreamError):
    """Reading D's binding failed: the metaserver did not answer in time, refused the
    connection or answered 5xx. Decode-first then lets D compute the prompt itself."""


class UpstreamRejected(UpstreamError):
    """A 4xx from a backend: the request itself is wrong, so it goes back to the client, as
    an OpenAI error rebuilt from what the backend said (never its bytes as they came)."""

    retryable = False

    def __init__(self, status: int, raw: bytes) -> None:
        said = _openai_error(raw)
        super().__init__(f"backend answered {status}: {said.message if said else raw[:300]!r}")
        self.status = status
        self._said = said

    @property
    def public(self) -> str:
        return self._said.message if self._said is not None else f"rejected ({self.status})"

    def body(self) -> bytes:
        said = self._said
        if said is None:
            return error_json(self.public, "invalid_request_error", self.status)
        code = said.code if isinstance(said.code, int | str) else self.status
        return msgspec.json.encode(
            {"error": {"message": said.message, "type": said.type, "param": said.param,
                       "code": code}}
        )  # fmt: skip


class _ErrorFields(msgspec.Struct):
    message: Annotated[str, msgspec.Meta(max_length=4096)] = ""
    type: Annotated[str, msgspec.Meta(max_length=128)] = "invalid_request_error"
    param: Annotated[str, msgspec.Meta(max_length=256)] | None = None
    code: int | Annotated[str, msgspec.Meta(max_length=128)] | None = None


class _Wrapped(msgspec.Struct):
    error: _ErrorFields


class _Said(msgspec.Struct):
    error: Annotated[str, msgspec.Meta(max_length=4096)]


_wrapped = msgspec.json.Decoder(_Wrapped)
_flat = msgspec.json.Decoder(_ErrorFields)  # vLLM's older ErrorResponse: the fields at the top
_said = msgspec.json.Decoder(_Said)  # {"error": "text"}


def _openai_error(raw: bytes) -> _ErrorFields | None:
    """vLLM's error answer (``{"error": {...}}``, its fields at the top level, or
    ``{"error": "text"}``), its known fields only; ``None`` when the bytes are none of these."""
    for decode in (_wrapped.decode, _flat.decode, _said.decode):
        try:
            got = decode(raw)
        except msgspec.DecodeError:
            continue
        if isinstance(got, _Said):
            return _ErrorFields(message=got.error)
        fields = got.error if isinstance(got, _Wrapped) else got
        if fields.message:
            return fields
    return None


def error_object(message: str, kind: str, code: int | str | None) -> dict[str, Any]:
    return {"error": {"message": message, "type": kind, "param": None, "code": code}}


def error_json(message: str, kind: str, code: int | str | None) -> bytes:
    return msgspec.json.encode(error_object(message, kind, code))


def sse_error_event(message: str, kind: str = "upstream_error", code: int = 502) -> bytes:
    """What ends a stream that broke after its first byte: an error event, then ``[DONE]``."""
    return b"data: " + error_json(message, kind, code) + b"\n\ndata: [DONE]\n\n"
