"""The metaserver's exception tree; ``app._install_error_handlers`` maps it to HTTP status once.

MetaserverError
├── NotFound              404
├── Conflict              409  (different content for an existing id, illegal state change)
├── Unprocessable         422  (valid JSON, unacceptable meaning: unknown decode instance …)
├── Unauthorized          401
├── Forbidden             403  (a known credential whose role does not allow the call)
├── PayloadTooLarge       413
└── Unavailable           503  (retry later)
    ├── StoreUnavailable       (Redis down or too slow)
    └── IdentityUnavailable    (the Kubernetes API cannot review a token now)
"""

from __future__ import annotations


class MetaserverError(Exception):
    status_code = 500

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class NotFound(MetaserverError):
    status_code = 404


class Conflict(MetaserverError):
    status_code = 409


class Unprocessable(MetaserverError):
    status_code = 422


class Unauthorized(MetaserverError):
    status_code = 401


class Forbidden(MetaserverError):
    status_code = 403


class PayloadTooLarge(MetaserverError):
    status_code = 413


class Unavailable(MetaserverError):
    status_code = 503


class StoreUnavailable(Unavailable):
    pass


class IdentityUnavailable(Unavailable):
    pass
