"""pd-launch on accelerators: every engine gets its own devices (prefill first, tp each)."""

from __future__ import annotations

import pytest

from launch.options import Child
from launch.plan import build_plan
from tests.launch.options import options


def engine_env(children: list[Child], var: str) -> dict[str, str]:
    return {c.name: c.env.get(var, "") for c in children if c.kind == "engine"}


def test_plan_cuda_engines_get_disjoint_devices(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    opts = options(model="m", device="cuda", prefill=2, decode=1, tp_prefill=1, tp_decode=2)
    plan = build_plan(opts)
    assert engine_env(plan.children, "CUDA_VISIBLE_DEVICES") == {
        "prefill-0": "0",
        "prefill-1": "1",
        "decode-0": "2,3",
    }


def test_plan_npu_engines_follow_the_parents_visible_list(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ASCEND_RT_VISIBLE_DEVICES", "4,5,6,7")
    plan = build_plan(options(model="m", device="npu", prefill=1, decode=1, tp_decode=2))
    assert engine_env(plan.children, "ASCEND_RT_VISIBLE_DEVICES") == {
        "prefill-0": "4",
        "decode-0": "5,6",
    }


def test_plan_too_few_visible_devices_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    with pytest.raises(ValueError, match="too few devices"):
        build_plan(options(model="m", device="cuda", prefill=1, decode=1))


def test_plan_cpu_engines_get_no_device_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    plan = build_plan(options(model="m", prefill=2, decode=2))
    for child in plan.children:
        assert "CUDA_VISIBLE_DEVICES" not in child.env
        assert "ASCEND_RT_VISIBLE_DEVICES" not in child.env
