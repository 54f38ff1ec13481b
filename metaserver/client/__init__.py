"""Clients for the other parts of pdgate.

* ``AsyncMetaserverClient`` (aiohttp) — the proxy;
* ``MetaserverClient`` (blocking) and ``BackgroundWriter`` (fire-and-forget, one thread) — the
  vLLM connector, whose scheduler thread must never block on the network.
"""

from metaserver.client.aio import AsyncMetaserverClient
from metaserver.client.errors import (
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
from metaserver.client.retry import NO_BACKOFF, Backoff, RetryPolicy
from metaserver.client.sync import BackgroundWriter, MetaserverClient

__all__ = [
    "NO_BACKOFF",
    "AsyncMetaserverClient",
    "AuthError",
    "Backoff",
    "BackgroundWriter",
    "BadRequest",
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
]
