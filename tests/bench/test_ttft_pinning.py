"""``ttft_bench --pinned`` places the processes it compares on the cores it claims to."""

from __future__ import annotations

from pathlib import Path

from launch.plan import LaunchOptions, build_plan
from tests.bench.ttft_bench import pin_plan, pinned
from tests.e2e.stack import monolithic_child


def test_ttft_pinned_monolithic_engine_runs_alone_on_core_0() -> None:
    child = pinned(monolithic_child(Path("/m")), "0")
    assert child.argv[:3] == ["taskset", "-c", "0"]
    assert child.env["VLLM_CPU_OMP_THREADS_BIND"] == "0"


def test_ttft_pinned_plan_puts_p_on_core_0_and_the_rest_on_core_1() -> None:
    plan = build_plan(LaunchOptions(model="/m"))
    placed = {c.name: c for c in pin_plan(plan.children)}
    cores = {name: c.argv[2] for name, c in placed.items()}
    assert cores.pop("prefill-0") == "0"
    assert set(cores.values()) == {"1"} and {"decode-0", "metaserver", "proxy"} <= set(cores)
    assert placed["prefill-0"].env["VLLM_CPU_OMP_THREADS_BIND"] == "0"
    assert placed["decode-0"].env["VLLM_CPU_OMP_THREADS_BIND"] == "1"
    assert "VLLM_CPU_OMP_THREADS_BIND" not in placed["proxy"].env  # not an engine
    for name, c in placed.items():  # the command itself is unchanged after taskset
        original = next(o for o in plan.children if o.name == name)
        assert c.argv[3:] == original.argv
