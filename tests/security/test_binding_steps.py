"""Whose step each binding event is, on a real ``pd-metaserver`` in roles mode over Redis (the
chart's default store).

Before, any engine credential could post any state on any transfer as long as ``actor`` named
itself: the prefill pool aborted the decode pool's bindings, a decode credential took P's lease,
and a second ``prefill_started`` by another prefill answered 200 (P took any 200 for "won"), so
the lease did not exclude a second P. The proxy could abort any binding too. Now the lease is a
registered prefill's and exclusive (409 for a second claimant), ``pushing``/``done`` are the
holder's, ``aborted`` the decode's, and the proxy only adds marks."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import httpx

from tests.metaserver.conftest import TOKENS, at, binding_spec, decode_instance, write_credentials
from tests.support.services import MetaserverProcess, RedisServer


def _as(name: str) -> dict[str, str]:
    return {"authorization": f"Bearer {TOKENS[name]}"}


def test_each_step_of_a_transfer_is_its_owners(
    redis_server: RedisServer,
    metaserver_factory: Callable[..., MetaserverProcess],
    tmp_path: Path,
) -> None:
    ms = metaserver_factory(
        redis_server.url, "--credentials-file", str(write_credentials(tmp_path)),
        "--namespace", "steps",
    )  # fmt: skip
    with httpx.Client(base_url=ms.url, timeout=10) as c:

        def register(iid: str, who: str, role: str) -> None:
            spec = decode_instance(role=role, **at(iid)).model_dump(mode="json")
            assert c.put(f"/v1/instances/{iid}", json=spec, headers=_as(who)).status_code == 201

        def bind(tid: str) -> None:
            spec = binding_spec().model_dump(mode="json")
            assert c.put(f"/v1/bindings/{tid}", json=spec, headers=_as("decode-0")).is_success

        def post(tid: str, state: str, actor: str, who: str) -> int:
            body = {"state": state, "actor": actor}
            return c.post(f"/v1/bindings/{tid}/events", json=body, headers=_as(who)).status_code

        def state(tid: str) -> str:
            return str(c.get(f"/v1/bindings/{tid}", headers=_as("reader")).json()["state"])

        register("decode-0", "decode-0", "decode")
        register("prefill-a", "prefill-pool", "prefill")
        register("prefill-b", "prefill-pool", "prefill")
        for tid in ("t1", "t2", "t3", "t4"):
            bind(tid)

        # the attacks, each refused, each binding untouched
        assert post("t1", "aborted", "prefill-a", "prefill-pool") == 403  # P ends D's transfer
        assert post("t1", "failed", "prefill-a", "prefill-pool") == 403  # ... not taken by it
        assert post("t2", "prefill_started", "decode-0", "decode-0") == 403  # D takes P's lease
        assert post("t1", "failed", "proxy", "proxy") == 403  # the proxy moves a transfer
        assert [state(t) for t in ("t1", "t2")] == ["bound", "bound"]
        assert post("t3", "prefill_started", "prefill-a", "prefill-pool") == 200
        assert post("t3", "prefill_started", "prefill-b", "prefill-pool") == 409  # a second P
        assert post("t3", "pushing", "prefill-b", "prefill-pool") == 403
        assert post("t3", "done", "prefill-b", "prefill-pool") == 403
        held = c.get("/v1/bindings/t3", headers=_as("reader")).json()
        assert [(e["state"], e["actor"]) for e in held["events"]] == [
            ("bound", "decode-0"), ("prefill_started", "prefill-a"),
        ]  # fmt: skip

        # what each part legitimately does still goes through
        assert post("t3", "prefill_started", "prefill-a", "prefill-pool") == 200  # its retry
        assert post("t3", "pushing", "prefill-a", "prefill-pool") == 200
        assert post("t3", "done", "prefill-a", "prefill-pool") == 200
        assert post("t1", "aborted", "decode-0", "decode-0") == 200
        assert post("t2", "prefill_started", "prefill-b", "prefill-pool") == 200
        assert post("t2", "failed", "prefill-b", "prefill-pool") == 200
        mark = {"mark": "abandoned", "actor": "proxy", "detail": {"outcome": "aborted"}}
        assert c.post("/v1/bindings/t4/marks", json=mark, headers=_as("proxy")).status_code == 204
        assert post("t4", "aborted", "ops", "admin") == 200
        assert [state(t) for t in ("t1", "t2", "t3", "t4")] == [
            "aborted", "failed", "done", "aborted"
        ]  # fmt: skip
