"""The chaos suite's observing reads (``tests/e2e/observe.py``): a read whose connection broke is
sent again, nothing else is."""

from __future__ import annotations

import httpx
import pytest

from tests.e2e.observe import READ_TRIES, RetryingReads


def _breaking(
    times: int, error: type[httpx.TransportError] = httpx.ReadError
) -> tuple[httpx.MockTransport, list[str]]:
    seen: list[str] = []

    def handle(request: httpx.Request) -> httpx.Response:
        seen.append(request.method)
        if len(seen) <= times:
            raise error("connection closed by the peer", request=request)
        return httpx.Response(200, json={"state": "pushing"})

    return httpx.MockTransport(handle), seen


async def test_observe_get_is_sent_again_after_a_broken_connection() -> None:
    inner, seen = _breaking(READ_TRIES - 1)
    transport = RetryingReads(inner)
    async with httpx.AsyncClient(base_url="http://ms", transport=transport) as ms:
        r = await ms.get("/v1/bindings/t1")
    assert r.json() == {"state": "pushing"}
    assert seen == ["GET"] * READ_TRIES
    assert transport.retried == READ_TRIES - 1


async def test_observe_get_gives_up_after_its_tries() -> None:
    inner, seen = _breaking(READ_TRIES, httpx.RemoteProtocolError)
    async with httpx.AsyncClient(base_url="http://ms", transport=RetryingReads(inner)) as ms:
        with pytest.raises(httpx.RemoteProtocolError):
            await ms.get("/v1/bindings/t1")
    assert len(seen) == READ_TRIES


async def test_observe_post_and_timeouts_are_not_sent_again() -> None:
    inner, seen = _breaking(1)
    async with httpx.AsyncClient(base_url="http://ms", transport=RetryingReads(inner)) as ms:
        with pytest.raises(httpx.ReadError):
            await ms.post("/v1/bindings/t1/events", json={})
    assert seen == ["POST"]
    inner, seen = _breaking(1, httpx.ReadTimeout)
    async with httpx.AsyncClient(base_url="http://ms", transport=RetryingReads(inner)) as ms:
        with pytest.raises(httpx.ReadTimeout):
            await ms.get("/v1/bindings/t1")
    assert seen == ["GET"]
