"""Roles on the metaserver (``metaserver.access``): each credential may do what its role allows
and nothing else, on the fast path and on FastAPI's routes alike. Authorization does not depend
on the store, so these run on the memory store."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from metaserver import MetaserverSettings, create_app
from metaserver.backend import memory_backend
from metaserver.cli import _build
from metaserver.store import MemoryStore
from tests.metaserver.conftest import TOKENS, at, binding_spec, decode_instance, write_credentials


def bearer(name: str) -> dict[str, str]:
    return {"authorization": f"Bearer {TOKENS[name]}"}


@pytest.fixture
async def roles(tmp_path: Path) -> AsyncIterator[httpx.AsyncClient]:
    settings = MetaserverSettings(credentials_file=write_credentials(tmp_path), protect_reads=True)
    store = MemoryStore(binding_ttl_s=60, retain_s=60)
    await store.start()
    app = create_app(settings, backend=memory_backend(store))
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url="http://ms") as c:
        yield c
    await store.close()


def spec(decode: str = "decode-0") -> dict[str, Any]:
    return binding_spec(decode_instance_id=decode).model_dump(mode="json")


def instance(role: str = "decode", iid: str = "decode-0") -> dict[str, Any]:
    return decode_instance(role=role, **at(iid)).model_dump(mode="json")


async def test_no_or_wrong_token_is_401_and_reader_reads_only(roles: httpx.AsyncClient) -> None:
    assert (await roles.get("/v1/instances")).status_code == 401  # --protect-reads
    wrong = {"authorization": "Bearer " + "x" * 22}
    assert (await roles.put("/v1/bindings/t1", json=spec(), headers=wrong)).status_code == 401
    assert (await roles.get("/v1/instances", headers=bearer("reader"))).status_code == 200
    assert (await roles.get("/v1/stats", headers=bearer("reader"))).status_code == 200
    for call in (
        roles.put("/v1/bindings/t1", json=spec(), headers=bearer("reader")),
        roles.put("/v1/instances/decode-0", json=instance(), headers=bearer("reader")),
        roles.put("/v1/instances/decode-0/drain", headers=bearer("reader")),
    ):
        r = await call
        assert r.status_code == 403 and "reader" in r.json()["detail"], r.text


async def test_an_engine_acts_only_as_its_own_instance(roles: httpx.AsyncClient) -> None:
    me = bearer("decode-0")
    put = roles.put
    assert (await put("/v1/instances/decode-0", json=instance(), headers=me)).status_code == 201
    r = await put("/v1/instances/decode-1", json=instance(), headers=me)
    assert r.status_code == 403 and "decode-1" in r.json()["detail"]
    # its engine_role: the decode credential cannot register itself as a prefill
    r = await put("/v1/instances/decode-0", json=instance("prefill"), headers=me)
    assert r.status_code == 403
    # bindings naming itself only: it cannot send a victim's KV to another decode
    assert (await put("/v1/bindings/t1", json=spec(), headers=me)).status_code == 201
    r = await put("/v1/bindings/t2", json=spec("decode-1"), headers=me)
    assert r.status_code == 403
    assert (await roles.get("/v1/bindings/t2", headers=me)).status_code == 404  # nothing stored
    # events as itself, and only its own steps (a decode takes no lease); no marks; no
    # deletes; its own drain only
    post = roles.post
    lease = {"state": "prefill_started", "actor": "decode-0"}
    assert (await post("/v1/bindings/t1/events", json=lease, headers=me)).status_code == 403
    forged = {"state": "failed", "actor": "proxy"}
    assert (await post("/v1/bindings/t1/events", json=forged, headers=me)).status_code == 403
    ok = {"state": "aborted", "actor": "decode-0"}
    assert (await post("/v1/bindings/t1/events", json=ok, headers=me)).status_code == 200
    mark = {"mark": "first_token", "actor": "decode-0"}
    assert (await post("/v1/bindings/t1/marks", json=mark, headers=me)).status_code == 403
    assert (await roles.delete("/v1/bindings/t1", headers=me)).status_code == 403
    assert (await put("/v1/instances/decode-0/drain", headers=me)).status_code == 200
    admin = bearer("admin")
    other = decode_instance(
        url="http://10.0.0.9:8200", kv_endpoint={"host": "10.0.0.9", "port": 5600}
    )
    nine = other.model_dump(mode="json")
    assert (await put("/v1/instances/decode-9", json=nine, headers=admin)).status_code == 201
    assert (await put("/v1/instances/decode-9/drain", headers=me)).status_code == 403
    assert (await roles.delete("/v1/instances/decode-9", headers=me)).status_code == 403
    assert (await roles.delete("/v1/instances/decode-0", headers=me)).status_code == 204


async def test_a_pool_credential_covers_its_prefix_and_role_only(roles: httpx.AsyncClient) -> None:
    pool = bearer("prefill-pool")
    put = roles.put
    body = instance("prefill")
    assert (await put("/v1/instances/prefill-7f9c", json=body, headers=pool)).status_code == 201
    assert (await put("/v1/instances/decode-7f9c", json=body, headers=pool)).status_code == 403
    decoy = instance("decode")  # a compromised prefill pod cannot plant a decoder
    assert (await put("/v1/instances/prefill-x", json=decoy, headers=pool)).status_code == 403
    assert (await put("/v1/bindings/t1", json=spec(), headers=pool)).status_code == 403


async def test_the_proxy_marks_and_drains_but_neither_binds_nor_moves_a_transfer(
    roles: httpx.AsyncClient,
) -> None:
    proxy, engine = bearer("proxy"), bearer("decode-0")
    assert (await roles.put("/v1/instances/decode-0", json=instance(), headers=engine)).is_success
    assert (await roles.put("/v1/bindings/t1", json=spec(), headers=engine)).status_code == 201
    assert (await roles.put("/v1/bindings/t2", json=spec(), headers=proxy)).status_code == 403
    for state in ("prefill_started", "failed", "aborted"):
        moved = {"state": state, "actor": "proxy"}
        r = await roles.post("/v1/bindings/t1/events", json=moved, headers=proxy)
        assert r.status_code == 403, state
    gave_up = {"mark": "abandoned", "actor": "proxy", "detail": {"outcome": "failed"}}
    r = await roles.post("/v1/bindings/t1/marks", json=gave_up, headers=proxy)
    assert r.status_code == 204
    mark = {"mark": "first_token", "actor": "proxy"}
    assert (await roles.post("/v1/bindings/t1/marks", json=mark, headers=proxy)).status_code == 204
    assert (await roles.put("/v1/instances/decode-0/drain", headers=proxy)).status_code == 200
    assert (await roles.delete("/v1/instances/decode-0/drain", headers=proxy)).status_code == 200
    assert (await roles.delete("/v1/instances/decode-0", headers=proxy)).status_code == 403
    assert (await roles.delete("/v1/bindings/t1", headers=proxy)).status_code == 403
    assert (await roles.delete("/v1/bindings/t1", headers=bearer("admin"))).status_code == 204


async def test_only_proxies_share_load_and_ask_the_kv_index_and_readers_read_load(
    roles: httpx.AsyncClient,
) -> None:
    load = {"instances": {"http://p0": [1, 10]}}
    assert (await roles.put("/v1/load/r1", json=load, headers=bearer("proxy"))).status_code == 200
    refused = await roles.put("/v1/load/r1", json=load, headers=bearer("decode-0"))
    assert refused.status_code == 403 and "share proxy load" in refused.text
    assert (await roles.put("/v1/load/r1", json=load)).status_code == 401
    assert (await roles.get("/v1/load/r2", headers=bearer("reader"))).json()["replicas"] == 1
    assert (await roles.get("/v1/load/r2")).status_code == 401  # protect-reads
    placed = {"placed": [{"instance": "prefill-0", "keys": [1]}]}
    assert (await roles.post("/v1/kv/placed", json=placed, headers=bearer("proxy"))).is_success
    refused = await roles.post("/v1/kv/placed", json=placed, headers=bearer("reader"))
    assert refused.status_code == 403
    assert (await roles.post("/v1/kv/placed", json=placed)).status_code == 401
    match = {"keys": [1], "instances": ["decode-0"]}
    assert (await roles.post("/v1/kv/match", json=match)).status_code == 401  # protect-reads
    for who, status in (("proxy", 200), ("admin", 200), ("reader", 403), ("decode-0", 403)):
        got = await roles.post("/v1/kv/match", json=match, headers=bearer(who))
        assert got.status_code == status, who  # a routing question: the proxy's to ask


async def test_a_batch_answers_each_call_by_its_own_right(roles: httpx.AsyncClient) -> None:
    calls = [
        {"method": "PUT", "path": "/v1/bindings/t1", "body": spec()},
        {"method": "PUT", "path": "/v1/bindings/t2", "body": spec("decode-1")},
        {"method": "POST", "path": "/v1/bindings/t1/marks",
         "body": {"mark": "end", "actor": "decode-0"}},
    ]  # fmt: skip
    me = bearer("decode-0")
    assert (await roles.put("/v1/instances/decode-0", json=instance(), headers=me)).is_success
    r = await roles.post("/v1/batch", json={"calls": calls}, headers=bearer("decode-0"))
    assert r.status_code == 200
    assert [x["status"] for x in r.json()["results"]] == [201, 403, 403]


async def test_single_token_mode_still_does_everything(tmp_path: Path) -> None:
    app = create_app(MetaserverSettings(token="one-token-for-all-0123"))
    headers = {"authorization": "Bearer one-token-for-all-0123"}
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url="http://ms") as c:
        r = await c.put("/v1/instances/d-3", json=instance(iid="d-3"), headers=headers)
        assert r.status_code == 201
        assert (
            await c.put("/v1/bindings/t1", json=spec("d-3"), headers=headers)
        ).status_code == 201
        assert (await c.delete("/v1/bindings/t1", headers=headers)).status_code == 204
        assert (await c.put("/v1/bindings/t1", json=spec())).status_code == 401


@pytest.mark.parametrize(
    ("text", "says"),
    [
        ("credentials:\n  - {name: e, role: engine, token: 0123456789abcdef0}\n", "needs instance"),
        ("credentials:\n  - {name: a, role: admin, token: short}\n", "at least 16"),
        (
            "credentials:\n  - {name: a, role: admin, token: 0123456789abcdef0}\n"
            "  - {name: b, role: proxy, token: 0123456789abcdef0}\n",
            "same token appears twice",
        ),
        ("credentials:\n  - {name: r, role: root, token: 0123456789abcdef0}\n", "role"),
        ("credentials:\n  - {name: a, role: admin, token_file: /nonexistent/x}\n", "nonexistent"),
    ],
)
def test_a_bad_credentials_file_is_a_clear_cli_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], text: str, says: str
) -> None:
    path = tmp_path / "credentials.yaml"
    path.write_text(text)
    with pytest.raises(SystemExit) as exited:
        _build(MetaserverSettings(credentials_file=path))
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert str(path) in err and says in err, err
    assert "0123456789abcdef0" not in err and "short" not in err  # no token is repeated
