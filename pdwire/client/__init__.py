"""The metaserver's clients, shared by the proxy and the connector.

* ``AsyncMetaserverClient`` (aiohttp) — the proxy;
* ``MetaserverClient`` (blocking) and ``BackgroundWriter`` (fire-and-forget, a few threads) — the
  vLLM connector, whose scheduler thread must never block on the network.
"""

from pdwire.client._protocol import auth_headers, binding_url
from pdwire.client.aio import AsyncMetaserverClient
from pdwire.client.errors import (
    AuthError,
    BadRequest,
    ConflictError,
    MetaserverClientError,
    MetaserverHTTPError,
    MetaserverUnavailable,
    NotFoundError,
    PayloadTooLargeError,
    ServerError,
    ValidationFailed,
)
from pdwire.client.retry import NO_BACKOFF, Backoff, RetryPolicy
from pdwire.client.sync import MetaserverClient
from pdwire.client.writer import BackgroundWriter, BindingWrite

__all__ = [
    "NO_BACKOFF",
    "AsyncMetaserverClient",
    "AuthError",
    "Backoff",
    "BackgroundWriter",
    "BadRequest",
    "BindingWrite",
    "ConflictError",
    "MetaserverClient",
    "MetaserverClientError",
    "MetaserverHTTPError",
    "MetaserverUnavailable",
    "NotFoundError",
    "PayloadTooLargeError",
    "RetryPolicy",
    "ServerError",
    "ValidationFailed",
    "auth_headers",
    "binding_url",
]
