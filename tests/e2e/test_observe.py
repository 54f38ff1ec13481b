"""The chaos suite's observing reads (``tests/e2e/observe.py``): a read whose connection broke is
sent again, nothing else is; the newest binding is read once it settled, or as it stands."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator

import httpx
import pytest

from tests.e2e.observe import READ_TRIES, RetryingReads, newest_binding
from tests.metaserver.conftest import binding_spec, decode_instance
from tests.support.services import MetaserverProcess


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


@pytest.fixture(scope="module")
def metaserver(tmp_path_factory: pytest.TempPathFactory) -> Iterator[MetaserverProcess]:
    ms = MetaserverProcess("memory", log_dir=tmp_path_factory.mktemp("observe"))
    try:
        yield ms
    finally:
        ms.stop()


async def _bound(url: str, tid: str) -> httpx.AsyncClient:
    api = httpx.AsyncClient(base_url=url, timeout=10)
    r = await api.put("/v1/instances/decode-0", content=decode_instance().model_dump_json())
    assert r.status_code in (200, 201), r.text  # 200: registered again (a heartbeat)
    r = await api.put(f"/v1/bindings/{tid}", content=binding_spec().model_dump_json())
    assert r.status_code == 201, r.text
    return api


async def test_observe_newest_binding_waits_for_p_s_last_event(
    metaserver: MetaserverProcess,
) -> None:
    api = await _bound(metaserver.url, "late-done")
    t0 = time.monotonic()

    async def p_finishes() -> None:  # P's done, posted after the client's answer
        await asyncio.sleep(0.3)
        for state in ("pushing", "done"):
            r = await api.post("/v1/bindings/late-done/events", json={"state": state, "actor": "p"})
            assert r.status_code == 200, r.text

    try:
        late = asyncio.create_task(p_finishes())
        b = await newest_binding(metaserver.url)
        await late
    finally:
        await api.aclose()
    assert b["transfer_id"] == "late-done" and b["state"] == "done"
    assert time.monotonic() - t0 >= 0.3
    assert [e["state"] for e in b["events"]] == ["bound", "pushing", "done"]


async def test_observe_newest_binding_gives_it_as_it_stands_after_the_settle_time(
    metaserver: MetaserverProcess,
) -> None:
    api = await _bound(metaserver.url, "never-done")
    try:
        t0 = time.monotonic()
        b = await newest_binding(metaserver.url, settle_s=0.3)
    finally:
        await api.aclose()
    assert b["transfer_id"] == "never-done" and b["state"] == "bound"
    assert 0.3 <= time.monotonic() - t0 < 5
