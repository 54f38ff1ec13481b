"""One rendering of errors for every path (FastAPI handlers and the fast path)."""

from __future__ import annotations

import json
import logging

from metaserver.errors import MetaserverError, StoreUnavailable, Unavailable
from metaserver.metrics import Metrics
from metaserver.validation import BodyInvalid

log = logging.getLogger("pdgate.metaserver")


def render_problem(
    exc: MetaserverError | BodyInvalid, metrics: Metrics
) -> tuple[int, bytes, list[tuple[bytes, bytes]]]:
    """(status, JSON body, extra headers) for an error raised while serving a request."""
    if isinstance(exc, BodyInvalid):
        return 422, json.dumps({"detail": exc.errors}).encode(), []
    headers: list[tuple[bytes, bytes]] = []
    if isinstance(exc, Unavailable):
        if isinstance(exc, StoreUnavailable):
            metrics.store_errors.inc()
        log.warning("unavailable: %s", exc.message)
        headers.append((b"retry-after", b"1"))
    return exc.status_code, json.dumps({"detail": exc.message}).encode(), headers
