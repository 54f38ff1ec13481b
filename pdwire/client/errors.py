"""Errors raised by the metaserver clients.

MetaserverClientError
├── MetaserverUnavailable      connection failed / timed out / 5xx, after the retries
└── MetaserverHTTPError        the server answered with an error status (4xx, or 5xx)
    ├── BadRequest             400
    ├── AuthError              401 / 403
    ├── NotFoundError          404
    ├── ConflictError          409
    ├── PayloadTooLargeError   413
    ├── ValidationFailed       422
    └── ServerError            5xx (raised when retries are exhausted)
"""

from __future__ import annotations

import json


class MetaserverClientError(Exception):
    pass


class MetaserverUnavailable(MetaserverClientError):
    pass


class MetaserverHTTPError(MetaserverClientError):
    def __init__(self, status: int, detail: object, method: str = "", path: str = "") -> None:
        super().__init__(f"{method} {path} -> {status}: {detail}")
        self.status = status
        self.detail = detail


class BadRequest(MetaserverHTTPError):
    pass


class AuthError(MetaserverHTTPError):
    pass


class NotFoundError(MetaserverHTTPError):
    pass


class ConflictError(MetaserverHTTPError):
    pass


class PayloadTooLargeError(MetaserverHTTPError):
    pass


class ValidationFailed(MetaserverHTTPError):
    pass


class ServerError(MetaserverHTTPError):
    pass


_BY_STATUS: dict[int, type[MetaserverHTTPError]] = {
    400: BadRequest,
    401: AuthError,
    403: AuthError,
    404: NotFoundError,
    409: ConflictError,
    413: PayloadTooLargeError,
    422: ValidationFailed,
}


def error_for_status(status: int, body: bytes, method: str, path: str) -> MetaserverHTTPError:
    try:
        detail: object = json.loads(body).get("detail", body.decode(errors="replace"))
    except (ValueError, AttributeError):
        detail = body.decode(errors="replace")[:500]
    cls = _BY_STATUS.get(status, ServerError if status >= 500 else MetaserverHTTPError)
    return cls(status, detail, method, path)
