"""The connector's series on the engines' own ``/metrics`` agree with what the pushes moved:
bytes pushed by the P engines == bytes landed on the D engines == the ``done`` events' bytes ==
blocks pushed x the bytes one block of the tiny model holds."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path
from typing import Any

import pytest

from connector import stats
from tests.e2e.client import client, complete
from tests.e2e.conftest import Engines
from tests.e2e.engine_metrics import connector_series, samples, series_names
from tests.e2e.stack import BLOCK_SIZE, CHUNK_TOKENS
from tests.e2e.test_equality import latest_binding, prompt_ids

pytestmark = pytest.mark.e2e

PREFILL = ("prefill-0", "prefill-1")
DECODE = ("decode-0", "decode-1")


def block_bytes(model_dir: Path) -> int:
    """One block over all layers: K and V of every KV head for BLOCK_SIZE tokens, float32."""
    cfg = json.loads((model_dir / "config.json").read_text())
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    kv = cfg["num_hidden_layers"] * cfg["num_key_value_heads"] * 2 * head_dim
    return int(kv * BLOCK_SIZE * 4)


async def _read(engines: Engines, names: tuple[str, ...]) -> dict[str, float]:
    """The engines' connector series, summed over ``names``."""
    total: dict[str, float] = {}
    for name in names:
        for key, value in (await connector_series(engines.pd.url_of(name), engines.model)).items():
            total[key] = total.get(key, 0.0) + value
    return total


def _delta(after: dict[str, float], before: dict[str, float], key: str) -> float:
    return after.get(key, 0.0) - before.get(key, 0.0)


async def test_e2e_engine_metrics_carry_the_connector_series(engines: Engines) -> None:
    # the series labelled by P's instance appear with their first value (test below)
    later = {n for s in stats.SERIES if s.label and not s.values for n in s.exposed}
    for name in PREFILL + DECODE:
        names = await series_names(engines.pd.url_of(name))
        missing = stats.exposed_names() - later - names
        assert not missing, (name, sorted(missing))


async def test_e2e_connector_metrics_agree_with_the_bytes_pushed(
    engines: Engines, tiny_model: Path
) -> None:
    p0, d0 = await _read(engines, PREFILL), await _read(engines, DECODE)
    ms0 = await samples(engines.pd.metaserver)
    per_block = block_bytes(tiny_model)
    pd = client(engines.pd.proxy)
    blocks = done_bytes = 0
    lengths = (BLOCK_SIZE - 5, 3 * BLOCK_SIZE + 7, 3 * CHUNK_TOKENS + 11)
    for i, length in enumerate(lengths):
        await complete(pd, engines.model, prompt_ids(length, seed=7100 + i), max_tokens=2)
        b: dict[str, Any] = await latest_binding(engines)
        assert b["num_prompt_tokens"] == length
        blocks += len(b["block_ids"][0]) - b["num_cached_tokens"] // BLOCK_SIZE
        done = _done_event(b)
        done_bytes += done["detail"]["bytes_pushed"]
    assert blocks == 1 + 4 + 6  # ceil(27 / 32), ceil(103 / 32), ceil(179 / 32)

    # P's last counts ship with its step that reports the push finished: wait for them
    deadline = time.monotonic() + 30
    while True:
        p1, d1 = await _read(engines, PREFILL), await _read(engines, DECODE)
        settled = (
            _delta(p1, p0, "vllm:pdgate_transfers_total{ok}") == len(lengths)
            and p1.get("vllm:pdgate_blocks_held{prefill}") == 0
            and d1.get("vllm:pdgate_blocks_held{decode}") == 0
        )
        if settled or time.monotonic() > deadline:
            break
        await asyncio.sleep(0.2)

    pushed = _delta(p1, p0, "vllm:pdgate_push_bytes_total")
    landed = _delta(d1, d0, "vllm:pdgate_recv_bytes_total")
    assert pushed == landed == done_bytes == blocks * per_block, (p1, d1)
    assert _delta(d1, d0, "vllm:pdgate_recv_blocks_total") == blocks
    # and D counted them under the P instances that pushed them, none recomputed
    by_p = {k: _delta(d1, d0, k) for k in d1 if k.startswith("vllm:pdgate_blocks_pushed_total{")}
    assert sum(by_p.values()) == blocks, by_p
    assert not any(k.endswith(("{none}", "{unknown}")) for k, v in by_p.items() if v), by_p
    recomputed = [k for k in d1 if k.startswith("vllm:pdgate_blocks_recomputed_total{")]
    assert all(_delta(d1, d0, k) == 0 for k in recomputed), d1
    assert _delta(p1, p0, "vllm:pdgate_transfers_total{ok}") == len(lengths)
    assert _delta(p1, p0, "vllm:pdgate_transfers_total{failed}") == 0
    assert _delta(d1, d0, "vllm:pdgate_loads_total") == len(lengths)
    for cause in stats.FAILURE_CAUSES:
        assert _delta(d1, d0, f"vllm:pdgate_load_failures_total{{{cause}}}") == 0
    assert _delta(d1, d0, "vllm:pdgate_recomputes_total") == 0
    # each loaded request was timed from its KV being all there to its first step on D
    assert _delta(d1, d0, "vllm:pdgate_kv_ready_wait_seconds_count") == len(lengths)
    assert 0 < _delta(d1, d0, "vllm:pdgate_kv_ready_wait_seconds_sum") < 5 * len(lengths)
    assert _delta(p1, p0, "vllm:pdgate_push_pieces_total") >= blocks
    # one push time and one exposed time per transfer; exposed is part of the push
    assert _delta(p1, p0, "vllm:pdgate_push_seconds_count") == len(lengths)
    assert _delta(p1, p0, "vllm:pdgate_push_exposed_seconds_count") == len(lengths)
    push_s = _delta(p1, p0, "vllm:pdgate_push_seconds_sum")
    assert 0 < push_s and 0 <= _delta(p1, p0, "vllm:pdgate_push_exposed_seconds_sum") <= push_s
    # D timed each binding write, and every one was accepted
    assert _delta(d1, d0, "vllm:pdgate_binding_write_seconds_count") == len(lengths)
    assert _delta(d1, d0, "vllm:pdgate_binding_writes_total{ok}") == len(lengths)
    # nothing is held once the transfers ended, on either side
    assert p1["vllm:pdgate_blocks_held{prefill}"] == 0
    assert d1["vllm:pdgate_blocks_held{decode}"] == 0
    # each P engine shook hands with the D engines it pushed to, and none failed
    assert p1["vllm:pdgate_handshakes_total{ok}"] >= 1
    assert p1["vllm:pdgate_handshakes_total{failed}"] == p0.get(
        "vllm:pdgate_handshakes_total{failed}", 0
    )
    # the autoscaling signals saw the same three transfers, and none is left in flight
    ms1 = await samples(engines.pd.metaserver)
    assert _delta(ms1, ms0, "pdgate_metaserver_prefill_queue_seconds_count") == len(lengths)
    assert _delta(ms1, ms0, "pdgate_metaserver_transfer_seconds_count{done}") == len(lengths)
    px = await samples(engines.pd.proxy)
    assert px["pd_transfers_inflight"] == 0 and px["pd_binding_waits"] == 0
    assert px["pd_binding_wait_seconds_count"] >= len(lengths)
    assert px["pd_binding_reads_total{feed}"] >= len(lengths)  # the binding feed served them


def _done_event(binding: dict[str, Any]) -> dict[str, Any]:
    """The ``done`` event of a binding ``latest_binding`` read once it settled."""
    done = [e for e in binding["events"] if e["state"] == "done"]
    assert done, binding["events"]
    event: dict[str, Any] = done[0]
    return event
