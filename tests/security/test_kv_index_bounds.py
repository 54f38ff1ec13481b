"""The KV-event index answers proxies only, about registered engines, with bounded work, on every
store (memory, Redis, Sentinel).

Before: ``POST /v1/kv/match`` was a read anyone could make (reads were open by default); one
188 KB body (8,192 keys x 1,024 made-up instance ids) had redis-py pack ~235 MB of commands on
the event loop (~45 s, security_review_2 N2); with vLLM's public default hash seed anyone could
learn whether a guessed prompt was cached, or sent by anyone in the last 10 s (N7); and a
placement for any instance name stayed in the memory index for good (N13). Now: the proxy (or
admin) role only, instances that registered a KV-event stream only (others answer 0 and cost
nothing), keys x instances capped, each instance's lookup stopping at its first miss (one Redis
script call, the keys sent once), placements for unregistered instances dropped."""

from __future__ import annotations

import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis

from metaserver.kvindex.index import PLACED_S
from pdwire.models import KV_MATCH_MAX_PRODUCT
from tests.metaserver.conftest import TOKENS, at, decode_instance, write_credentials

EVENTS = {"port": 5557, "block_size": 16}


def _as(name: str) -> dict[str, str]:
    return {"authorization": f"Bearer {TOKENS[name]}"}


async def _roles(api_factory: Callable[..., Any], tmp_path: Path) -> httpx.AsyncClient:
    api: httpx.AsyncClient = await api_factory(credentials_file=write_credentials(tmp_path))
    for iid, events in (("decode-0", True), ("decode-1", False)):
        spec = decode_instance(**at(iid)).model_dump(mode="json")
        if events:
            spec["kv_events"] = EVENTS
        assert (await api.put(f"/v1/instances/{iid}", json=spec, headers=_as("admin"))).is_success
    return api


async def test_kv_match_answers_proxies_about_registered_streams_only(
    api_factory: Callable[..., Any], tmp_path: Path
) -> None:
    api = await _roles(api_factory, tmp_path)
    rng = random.Random(1)
    keys = [rng.getrandbits(63) for _ in range(4)]
    placed = {"placed": [{"instance": i, "keys": keys} for i in ("decode-0", "decode-1", "ghost")]}
    assert (await api.post("/v1/kv/placed", json=placed, headers=_as("proxy"))).status_code == 204
    ask = {"keys": keys, "instances": ["decode-0", "decode-1", "ghost", "decode-0"]}
    for who in ("reader", "decode-0", "prefill-pool"):  # a prefix oracle for anyone: no more
        refused = await api.post("/v1/kv/match", json=ask, headers=_as(who))
        assert refused.status_code == 403, (who, refused.text)
    assert (await api.post("/v1/kv/match", json=ask)).status_code == 401
    got = await api.post("/v1/kv/match", json=ask, headers=_as("proxy"))
    assert got.status_code == 200, got.text
    # decode-0 (a KV-event stream) holds the placed prompt; decode-1 (none) and ghost (not
    # registered) are answered 0 without a lookup; the repeated id is answered once
    assert got.json()["matched"] == {"decode-0": 4, "decode-1": 0, "ghost": 0}
    assert PLACED_S > 1  # (the placement is still counted: the test runs well within it)


async def test_kv_match_caps_keys_times_instances(
    api_factory: Callable[..., Any], tmp_path: Path
) -> None:
    api = await _roles(api_factory, tmp_path)
    ids = [f"i-{n}" for n in range(16)]
    per = KV_MATCH_MAX_PRODUCT // len(ids)
    ok = {"keys": list(range(per)), "instances": ids}
    assert (await api.post("/v1/kv/match", json=ok, headers=_as("proxy"))).status_code == 200
    over = {"keys": list(range(per + 1)), "instances": ids}
    refused = await api.post("/v1/kv/match", json=over, headers=_as("proxy"))
    assert refused.status_code == 422 and "keys x instances" in refused.text, refused.text


@pytest.mark.parametrize("store_kind", ["redis"], indirect=True)
async def test_kv_match_sends_the_keys_once_and_stops_at_the_first_miss(
    api_factory: Callable[..., Any], tmp_path: Path, store_url: str
) -> None:
    api = await _roles(api_factory, tmp_path)
    for n in range(7):  # eight engines with streams: the most keys x instances allow 8,192 keys
        spec = decode_instance(**at(f"d-{n}")).model_dump(mode="json") | {"kv_events": EVENTS}
        await api.put(f"/v1/instances/d-{n}", json=spec, headers=_as("admin"))
    ids = ["decode-0", *(f"d-{n}" for n in range(7))]
    rng = random.Random(2)
    keys = [rng.getrandbits(63) for _ in range(KV_MATCH_MAX_PRODUCT // len(ids))]
    r = redis.Redis.from_url(store_url)
    before = _sent_to_redis(r)
    got = await api.post("/v1/kv/match", json={"keys": keys, "instances": ids},
                         headers=_as("proxy"))  # fmt: skip
    assert got.json()["matched"] == dict.fromkeys(ids, 0)
    sent = _sent_to_redis(r) - before
    # the keys once (about 21 bytes each as RESP), not once per instance and per structure
    # (before: 2 x 8 x 8,192 members, about 2.7 MB)
    assert sent < 2 * 21 * len(keys), sent
    r.close()


def _sent_to_redis(r: redis.Redis) -> int:
    return int(r.info("stats")["total_net_input_bytes"])
