"""``POST /v1/ascend/metaserver``: vllm-ascend D's blocks stored as a binding, vetted against the
decode pool, on each store (memory, real Redis, Redis behind Sentinel)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest

from metaserver.ascend.pool import DecodeEndpoints, PoolEntry
from metaserver.store import MemoryStore
from pdwire.ascend import COMPAT_PATH, binding_of_record, callback_urls, x_request_id_of
from tests.metaserver.conftest import TOKENS, decode_instance, write_credentials


def ascend_body(**over: Any) -> dict[str, Any]:
    """What ``update_state_after_alloc`` posts (mooncake_layerwise_connector.py)."""
    body: dict[str, Any] = {
        "token_ids": [],
        "request_id": "cmpl-pd-1-0",
        "do_remote_prefill": False,
        "do_remote_decode": True,
        "remote_block_ids": [[3, 4, 5]],
        "remote_block_size": [128],
        "remote_engine_id": "0c7f5a1e-d0",
        "remote_host": "10.0.0.9",
        "remote_port": 36000,
        "remote_tp_size": 4,
        "remote_pcp_size": 1,
        "remote_dcp_size": 1,
        "remote_cached_tokens": 128,
    }
    body.update(over)
    return body


async def test_ascend_post_is_stored_as_binding(api_factory: Callable[..., Any]) -> None:
    api: httpx.AsyncClient = await api_factory(ascend_decode=["10.0.0.9:36000-36007"])
    r = await api.post(COMPAT_PATH, json=ascend_body())
    assert r.status_code == 200, r.text
    assert r.json() == {"status": "ok", "request_id": "cmpl-pd-1-0", "created": True}
    got = await api.get("/v1/bindings/cmpl-pd-1-0")
    assert got.status_code == 200
    record = got.json()
    assert record["state"] == "bound"
    assert record["events"][0]["actor"] == "decode:0c7f5a1e-d0"
    assert binding_of_record(got.content) == ascend_body()
    # D's connector retries on transport errors: the same body again is fine, another is not
    again = await api.post(COMPAT_PATH, json=ascend_body())
    assert again.status_code == 200 and again.json()["created"] is False
    other = await api.post(COMPAT_PATH, json=ascend_body(remote_block_ids=[[9]]))
    assert other.status_code == 409


async def test_ascend_post_long_poll_wakes(api_factory: Callable[..., Any]) -> None:
    import asyncio

    api: httpx.AsyncClient = await api_factory(ascend_decode=["10.0.0.9:36000"])
    waiter = asyncio.create_task(api.get("/v1/bindings/chatcmpl-pd-2", params={"wait": 5}))
    await asyncio.sleep(0.1)
    r = await api.post(COMPAT_PATH, json=ascend_body(request_id="chatcmpl-pd-2"))
    assert r.status_code == 200
    got = await asyncio.wait_for(waiter, 5)
    assert got.status_code == 200 and got.json()["remote_port"] == 36000


@pytest.mark.parametrize(
    "over",
    [
        {"remote_host": "10.6.6.6"},  # another host
        {"remote_port": 36008},  # outside the range
    ],
)
async def test_ascend_post_outside_pool_is_refused(
    api_factory: Callable[..., Any], over: dict[str, Any]
) -> None:
    api: httpx.AsyncClient = await api_factory(ascend_decode=["10.0.0.9:36000-36007"])
    r = await api.post(COMPAT_PATH, json=ascend_body(**over))
    assert r.status_code == 422
    assert "not a KV endpoint of a known decode instance" in r.json()["detail"]
    assert (await api.get("/v1/bindings/cmpl-pd-1-0")).status_code == 404
    metrics = (await api.get("/metrics")).text
    assert "pdgate_metaserver_ascend_refused_total 1.0" in metrics


async def test_ascend_post_without_pool_is_refused(api_factory: Callable[..., Any]) -> None:
    api: httpx.AsyncClient = await api_factory(ascend_registry=False)
    r = await api.post(COMPAT_PATH, json=ascend_body())
    assert r.status_code == 422
    assert "no decode pool is configured" in r.json()["detail"]


async def test_ascend_post_registered_decode_counts(api_factory: Callable[..., Any]) -> None:
    import asyncio

    api: httpx.AsyncClient = await api_factory(ascend_refresh_s=0.05)
    r = await api.post(COMPAT_PATH, json=ascend_body(remote_host="10.0.0.7", remote_port=5600))
    assert r.status_code == 422  # nothing registered yet
    put = await api.put(
        "/v1/instances/decode-0", content=decode_instance().model_dump_json(exclude_none=True)
    )
    assert put.status_code == 201
    await asyncio.sleep(0.1)  # the registry is re-read every --ascend-refresh seconds
    r = await api.post(COMPAT_PATH, json=ascend_body(remote_host="10.0.0.7", remote_port=5600))
    assert r.status_code == 200, r.text
    wrong_port = await api.post(
        COMPAT_PATH, json=ascend_body(request_id="x-1", remote_host="10.0.0.7", remote_port=5601)
    )
    assert wrong_port.status_code == 422


@pytest.mark.parametrize(
    "over",
    [
        {"remote_block_ids": [[-1]]},
        {"remote_block_ids": [list(range(70_000))]},
        {"remote_port": 0},
        {"remote_host": "evil host"},
        {"do_remote_decode": False},
        {"token_ids": [1, 2]},
        {"request_id": "has space"},
        {"remote_tp_size": 0},
        {"surprise": 1},
    ],
)
async def test_ascend_post_bad_body_is_422(
    api_factory: Callable[..., Any], over: dict[str, Any]
) -> None:
    api: httpx.AsyncClient = await api_factory(ascend_decode=["10.0.0.9:36000"])
    r = await api.post(COMPAT_PATH, json=ascend_body(**over))
    assert r.status_code == 422, r.text
    assert (await api.get("/v1/bindings/cmpl-pd-1-0")).status_code == 404


async def test_ascend_post_needs_a_capability_for_its_request(
    api_factory: Callable[..., Any],
) -> None:
    """D posts to the URL the proxy gave it: a capability for one X-Request-Id, never a token."""
    token = "s3cret-s3cret-s3cret"
    api: httpx.AsyncClient = await api_factory(ascend_decode=["10.0.0.9:36000"], token=token)
    url = callback_urls(COMPAT_PATH, token)("pd-1")
    assert token not in url and "cap=" in url
    assert (await api.post(COMPAT_PATH, json=ascend_body())).status_code == 401
    bad = await api.post(url.replace("cap=", "cap=0"), json=ascend_body())
    assert bad.status_code == 401
    other = await api.post(url, json=ascend_body(request_id="cmpl-pd-2-0"))
    assert other.status_code == 403, other.text  # that capability names another request
    read = {"authorization": f"Bearer {token}"}
    assert (await api.get("/v1/bindings/cmpl-pd-2-0", headers=read)).status_code == 404
    assert (await api.post(url, json=ascend_body())).status_code == 200
    batch_child = await api.post(url, json=ascend_body(request_id="cmpl-pd-1-3"))
    assert batch_child.status_code == 200  # every prompt of that request's batch
    assert x_request_id_of("chatcmpl-pd-1") == "pd-1" and x_request_id_of("cmpl-pd-1-x") is None
    # an engine's credential cannot mint one: only proxy (and admin) tokens key them
    assert callback_urls(COMPAT_PATH, "engine-token-123456")("pd-1") != url


async def test_ascend_legacy_token_query_only_in_single_token_mode(
    api_factory: Callable[..., Any], tmp_path: Path
) -> None:
    token = "s3cret-s3cret-s3cret"
    api: httpx.AsyncClient = await api_factory(ascend_decode=["10.0.0.9:36000"], token=token)
    assert (await api.post(COMPAT_PATH + "?token=nope", json=ascend_body())).status_code == 401
    ok = await api.post(COMPAT_PATH + f"?token={token}", json=ascend_body())
    assert ok.status_code == 200
    roles = write_credentials(tmp_path, proxy=token)
    api = await api_factory(ascend_decode=["10.0.0.9:36000"], credentials_file=roles)
    assert (await api.post(COMPAT_PATH + f"?token={token}", json=ascend_body())).status_code == 401
    # without a capability only an admin's header may post (a proxy's gets 403)
    as_proxy = {"authorization": f"Bearer {token}"}
    r = await api.post(COMPAT_PATH, json=ascend_body(), headers=as_proxy)
    assert r.status_code == 403 and "without a capability" in r.json()["detail"]
    as_admin = {"authorization": f"Bearer {TOKENS['admin']}"}
    assert (await api.post(COMPAT_PATH, json=ascend_body(), headers=as_admin)).status_code == 200


async def test_decode_pool_resolves_dns_names() -> None:
    calls: list[str] = []

    async def resolve(name: str) -> list[str]:
        calls.append(name)
        return ["10.1.0.4", "10.1.0.5"]

    now = [0.0]
    pool = DecodeEndpoints(
        ["decode-headless.ns.svc:36000-36003"],
        MemoryStore(binding_ttl_s=1, retain_s=1),
        use_registry=False,
        refresh_s=5,
        resolve=resolve,
        clock=lambda: now[0],
    )
    assert await pool.problem("10.1.0.5", 36002) is None
    assert await pool.problem("10.1.0.6", 36002) is not None
    assert await pool.problem("10.1.0.4", 36004) is not None
    assert calls == ["decode-headless.ns.svc"]  # cached until refresh_s passes
    now[0] = 6.0
    assert await pool.problem("10.1.0.9", 36000) is not None
    assert calls == ["decode-headless.ns.svc"] * 2


def test_pool_entry_parse() -> None:
    assert PoolEntry.parse("10.0.0.1:36000") == PoolEntry("10.0.0.1", 36000, 36000)
    assert PoolEntry.parse("[fd00::1]:36000-36015") == PoolEntry("fd00::1", 36000, 36015)
    for bad in ("10.0.0.1", "h:0", "h:9-8", "h:x", ":36000", "a:1,b:2"):
        with pytest.raises(ValueError):
            PoolEntry.parse(bad)


def test_ascend_decode_setting_splits_commas_in_each_entry() -> None:
    from metaserver.cli import load_settings

    s = load_settings(["--ascend-decode", "a:1,b:2-3", "--ascend-decode", "c:4"])
    assert s.ascend_decode == ["a:1", "b:2-3", "c:4"]
