"""The binding long-poll on the data path: ``GET /v1/bindings/{id}?wait=S`` on the data-path
HTTP client; the metaserver's JSON answer is kept as raw bytes (``msgspec.Raw``) and embedded in
P's request as it came — no model parse and dump per request."""

from __future__ import annotations

import msgspec

from pdwire.client import auth_headers, binding_url
from proxy.backend import Backend
from proxy.errors import UpstreamError


class BindingMissing(Exception):
    """The metaserver answered 404: D wrote no binding within the wait."""


class BindingSource:
    def __init__(self, backend: Backend, base_url: str, token: str | None) -> None:
        self._backend = backend
        self.base_url = base_url.rstrip("/")
        self._headers = auth_headers(token) or None

    async def wait(self, transfer_id: str, wait_s: float) -> msgspec.Raw:
        """D's binding as JSON bytes; ``BindingMissing`` if it never appeared; ``UpstreamError``
        when the metaserver fails."""
        url = binding_url(self.base_url, transfer_id, wait_s)
        status, body = await self._backend.get(url, self._headers, wait_s + 5.0)
        if status == 200 and body[:1] == b"{":
            return msgspec.Raw(body)
        if status == 404:
            raise BindingMissing(transfer_id)
        raise UpstreamError(f"metaserver answered {status}: {body[:300].decode(errors='replace')}")
