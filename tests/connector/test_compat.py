"""The start-up check of the running vLLM, and the shims for vLLM before 0.32 (this module also
runs under vLLM 0.23 and 0.25: tests/connector/test_vllm_versions.py)."""

from __future__ import annotations

import logging
from typing import Any

import pytest
import vllm
from vllm.distributed.kv_transfer.kv_connector.v1 import base

from connector import compat
from connector.errors import ConfigError
from connector.metadata import PdgateMetadata
from connector.scheduler.blocks import BlockTracker


def test_compat_accepts_the_running_vllm_and_knows_its_generation() -> None:
    assert compat.check() == vllm.__version__
    version = compat.version_of(vllm.__version__)
    assert version is not None
    modern = version >= (0, 32)
    assert compat.features() == compat.Features(modern, modern, modern)


def test_compat_refuses_an_untested_version_in_one_line(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(vllm, "__version__", "0.28.1")
    monkeypatch.delenv(compat.ALLOW_ENV, raising=False)
    with pytest.raises(ConfigError) as exc:
        compat.check()
    text = str(exc.value)
    assert "\n" not in text
    assert "tested on vLLM 0.23-0.25, 0.32-0.33, not 0.28.1" in text and compat.ALLOW_ENV in text
    monkeypatch.setenv(compat.ALLOW_ENV, "1")
    with caplog.at_level(logging.WARNING, logger="pdgate.connector.compat"):
        assert compat.check() == "0.28.1"
    assert "running because PDGATE_ALLOW_UNTESTED_VLLM=1" in caplog.text


def test_compat_names_the_connector_api_a_vllm_lacks(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delattr(base.KVConnectorBase_V1, "handle_preemptions")
    monkeypatch.delattr(base.KVConnectorBase_V1, "get_block_ids_with_load_errors")
    with pytest.raises(ConfigError, match="has no handle_preemptions, get_block_ids_with_load"):
        compat.check()


def test_compat_layout_names_before_kv_cache_layout() -> None:
    assert compat.legacy_layout_name("LBHNC") == "HND"
    assert compat.legacy_layout_name("LBNHC") == "NHD"
    assert compat.legacy_layout_name("BLHNC") is None


class _Out:
    """The fields of vLLM's SchedulerOutput the block tracker reads."""

    def __init__(self, **kw: Any) -> None:
        self.finished_req_ids: set[str] = kw.get("finished", set())
        self.preempted_req_ids: set[str] = kw.get("preempted", set())
        self.scheduled_new_reqs = [_New(r, b) for r, b in kw.get("new", {}).items()]
        cached = kw.get("cached", {})
        self.scheduled_cached_reqs = _Cached(
            list(cached), list(cached.values()), kw.get("resumed", set())
        )


class _New:
    def __init__(self, req_id: str, blocks: list[int]) -> None:
        self.req_id, self.block_ids = req_id, (blocks,)


class _Cached:
    def __init__(self, ids: list[str], blocks: list[list[int] | None], resumed: set[str]) -> None:
        self.req_ids = ids
        self.new_block_ids = [None if b is None else (b,) for b in blocks]
        self.resumed_req_ids = resumed


def test_block_tracker_follows_blocks_through_steps_preemption_and_resume() -> None:
    t = BlockTracker()
    t.update(_Out(new={"a": [3, 4], "b": [7]}))
    t.update(_Out(cached={"a": [5], "b": None}))
    assert t.get_block_ids("a") == ([3, 4, 5],) and t.get_block_ids("b") == ([7],)
    t.update(_Out(preempted={"a"}, finished={"b"}))
    assert t.get_block_ids("a") == ([],) and t.get_block_ids("b") == ([],)
    t.update(_Out(cached={"a": [9, 10]}, resumed={"a"}))
    assert t.get_block_ids("a") == ([9, 10],)


class _Worker:
    """The worker half's surface the facade uses on vLLM before 0.32."""

    def __init__(self) -> None:
        self.ended: list[PdgateMetadata] = []

    def end_step(self, meta: PdgateMetadata) -> None:
        self.ended.append(meta)

    def transfer_results(self, finished: set[str]) -> tuple[set[str], set[str], set[str]]:
        return set(), {"ok", "bad"}, {"bad"}

    def blocks_of(self, req_ids: set[str]) -> set[int]:
        return {11, 12} if req_ids == {"bad"} else set()


def test_connector_reports_failed_loads_by_block_before_vllm_032() -> None:
    from connector.connector import PdgateConnector

    c = object.__new__(PdgateConnector)  # the facade alone: a worker double behind it
    c.worker, c.scheduler = _Worker(), None  # type: ignore[assignment]
    c._legacy, c._load_errors = True, set()
    meta = PdgateMetadata()
    c._connector_metadata = meta
    assert c.get_finished(set()) == (None, {"ok", "bad"})
    assert c.worker.ended == [meta]  # type: ignore[union-attr]  # no wait_for_save: ended here
    assert c.get_block_ids_with_load_errors() == {11, 12}
    assert c.get_block_ids_with_load_errors() == set()
    c._legacy = False  # vLLM 0.32 hears of them through failed_recving instead
    c.get_finished(set())
    assert c.get_block_ids_with_load_errors() == set()
