"""What an engine registers about its KV events (``connector.kv_events``), from vLLM's config."""

from __future__ import annotations

from pathlib import Path

import pytest
from vllm.config import KVEventsConfig

from connector.kv_events import kv_events_of
from tests.connector.harness import BLOCK, vllm_config


@pytest.mark.parametrize(
    ("endpoint", "replay", "expected"),
    [
        ("tcp://*:5557", "tcp://*:5558", (5557, 5558)),
        ("tcp://*:5557", None, (5557, None)),
        # pd-launch on 127.0.0.1: vLLM binds it (``::``), ZeroMQ on 127.0.0.1 alone
        ("tcp://[::ffff:127.0.0.1]:5557", "tcp://127.0.0.1:5558", (5557, 5558)),
        ("tcp://relay:5557", None, None),  # vLLM connects to a relay: nothing to follow here
        ("tcp://*:0", None, None),  # a port the registry cannot know
        ("ipc:///tmp/kv", None, None),
    ],
)
def test_registered_endpoint(
    tiny_model: Path, endpoint: str, replay: str | None, expected: tuple[int, int | None] | None
) -> None:
    config = vllm_config(tiny_model, "kv_both", {"metaserver_url": "http://ms"})
    config.kv_events_config = KVEventsConfig(
        enable_kv_cache_events=True, endpoint=endpoint, replay_endpoint=replay, topic="kv"
    )
    got = kv_events_of(config)
    if expected is None:
        assert got is None
        return
    assert got is not None
    assert (got.port, got.replay_port) == expected
    assert got.topic == "kv" and got.block_size == BLOCK and got.hash_algo == "sha256"


def test_off_without_events_or_prefix_caching(tiny_model: Path) -> None:
    config = vllm_config(tiny_model, "kv_both", {"metaserver_url": "http://ms"})
    assert kv_events_of(config) is None
    config.kv_events_config = KVEventsConfig(enable_kv_cache_events=True, endpoint="tcp://*:1")
    config.cache_config.enable_prefix_caching = False
    assert kv_events_of(config) is None
