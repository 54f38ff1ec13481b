"""The suite's own reads of the metaserver, to observe a scenario (not part of what it tests).

They wait out the machine's stalls (processes here have stalled for 10-24 s: see
docs/reliability.md) and send a read again when its connection broke before an answer came:
a CI run's long-poll got ``httpx.ReadError`` from a connection the metaserver had closed, and a
read cut short that way says nothing about the scenario."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import httpx

from pdwire.models import BindingState

OBSERVE_TIMEOUT_S = 30.0
READ_TRIES = 3
_BROKEN = (httpx.NetworkError, httpx.RemoteProtocolError)  # not timeouts: those are waited out


class RetryingReads(httpx.AsyncBaseTransport):
    """Sends a ``GET`` again, up to ``tries`` times in all, when its connection broke before
    the answer (connect, read or write error, or the peer closing mid-exchange). Other methods
    and every answer that came, whatever its status, pass through as they are."""

    def __init__(
        self, inner: httpx.AsyncBaseTransport | None = None, tries: int = READ_TRIES
    ) -> None:
        self.inner = inner or httpx.AsyncHTTPTransport()
        self.tries = tries
        self.retried = 0

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        for attempt in range(1, self.tries + 1):
            try:
                return await self.inner.handle_async_request(request)
            except _BROKEN:
                if request.method != "GET" or attempt == self.tries:
                    raise
                self.retried += 1
                await asyncio.sleep(0.1 * attempt)
        raise AssertionError("unreachable")

    async def aclose(self) -> None:
        await self.inner.aclose()


# a deployment's metaserver and proxy URLs -> their admin tokens (metaserver reads and the
# proxy's /v1/instances need one: the suite reads as the deployment's operator would;
# ``tests.e2e.stack`` records them)
CREDENTIALS: dict[str, str] = {}


def observer(base_url: str, timeout_s: float = OBSERVE_TIMEOUT_S) -> httpx.AsyncClient:
    """A client for the suite's observing reads of ``base_url`` (with its admin token)."""
    token = CREDENTIALS.get(base_url.rstrip("/"))
    headers = {"authorization": f"Bearer {token}"} if token else None
    return httpx.AsyncClient(
        base_url=base_url, timeout=timeout_s, transport=RetryingReads(), headers=headers
    )


SETTLE_S = 10.0


async def newest_binding(metaserver: str, settle_s: float = SETTLE_S) -> dict[str, Any]:
    """The newest binding, once it reached a final state (``done``, ``failed``, ``aborted``),
    or as it stands after ``settle_s``. P posts its last events from another process, through
    its background writer: they can land just after the client has its answer."""
    deadline = time.monotonic() + settle_s
    async with observer(metaserver) as ms:
        listed = (await ms.get("/v1/bindings", params={"limit": 1})).json()["bindings"]
        assert listed, "no binding recorded: the request did not go through P/D"
        binding: dict[str, Any] = listed[0]
        while not BindingState(binding["state"]).terminal and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
            binding = (await ms.get(f"/v1/bindings/{binding['transfer_id']}")).json()
    return binding
