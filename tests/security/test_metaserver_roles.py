"""A compromised engine against the metaserver, on real ``pd-metaserver`` processes over Redis.

With one token for everything (single-token mode, and every deployment before roles), an
engine pod's token registers a fake decoder and writes a binding that names it, so the next P
would push a victim's prompt KV there; it also drains every other instance. In roles mode the
same engine's credential acts only as itself: each of those calls is refused (403), while its
own registration, binding and events go through."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import httpx

from tests.metaserver.conftest import TOKENS, at, binding_spec, decode_instance, write_credentials
from tests.support.services import MetaserverProcess, RedisServer

FAKE = decode_instance(url="http://10.6.6.6:8200", kv_endpoint={"host": "10.6.6.6", "port": 5600})


def attack(ms: str, token: str) -> list[int]:
    """A compromised decode-0 engine: plant decode-evil, a binding naming it, drain decode-1."""
    auth = {"authorization": f"Bearer {token}"}
    with httpx.Client(base_url=ms, headers=auth, timeout=10) as c:
        plant = c.put("/v1/instances/decode-evil", content=FAKE.model_dump_json())
        spec = binding_spec(decode_instance_id="decode-evil", kv_endpoint=FAKE.kv_endpoint)
        bind = c.put("/v1/bindings/victim-1", content=spec.model_dump_json())
        drain = c.put("/v1/instances/decode-1/drain")
        return [plant.status_code, bind.status_code, drain.status_code]


def legitimate(ms: str, token: str) -> list[int]:
    """What decode-0's connector does: register itself, bind its own blocks, post an event."""
    auth = {"authorization": f"Bearer {token}"}
    with httpx.Client(base_url=ms, headers=auth, timeout=10) as c:
        me = c.put("/v1/instances/decode-0", content=decode_instance().model_dump_json())
        bind = c.put("/v1/bindings/own-1", content=binding_spec().model_dump_json())
        event = c.post("/v1/bindings/own-1/events", json={"state": "aborted", "actor": "decode-0"})
        return [me.status_code, bind.status_code, event.status_code]


def _register_decode_1(ms: str, token: str) -> None:
    auth = {"authorization": f"Bearer {token}"}
    spec = decode_instance(**at("decode-1")).model_dump_json()
    r = httpx.put(f"{ms}/v1/instances/decode-1", content=spec, headers=auth, timeout=10)
    assert r.status_code in (200, 201), r.text


def test_an_engine_credential_cannot_plant_a_decoder_or_a_binding(
    redis_server: RedisServer,
    metaserver_factory: Callable[..., MetaserverProcess],
    tmp_path: Path,
) -> None:
    shared = "one-token-every-pod-holds"
    single = metaserver_factory(redis_server.url, "--token", shared, "--namespace", "single")
    _register_decode_1(single.url, shared)
    assert attack(single.url, shared) == [201, 201, 200]  # the attack, on one shared token

    roles = metaserver_factory(
        redis_server.url, "--credentials-file", str(write_credentials(tmp_path)),
        "--namespace", "roles",
    )  # fmt: skip
    _register_decode_1(roles.url, TOKENS["admin"])
    assert attack(roles.url, TOKENS["decode-0"]) == [403, 403, 403]
    assert legitimate(roles.url, TOKENS["decode-0"]) == [201, 201, 200]
    read = {"authorization": f"Bearer {TOKENS['reader']}"}
    listed = httpx.get(f"{roles.url}/v1/instances", headers=read, timeout=10).json()["instances"]
    assert sorted(i["instance_id"] for i in listed) == ["decode-0", "decode-1"]
    assert not any(i["draining"] for i in listed)
    gone = httpx.get(f"{roles.url}/v1/bindings/victim-1", headers=read, timeout=10)
    assert gone.status_code == 404
