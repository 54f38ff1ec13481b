"""``ttft_bench --pinned`` places the processes it compares on the cores it claims to."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

from launch.options import LaunchOptions
from launch.plan import build_plan
from tests.bench import corecpu
from tests.bench.ttft_bench import MONO, pin_plan, pinned, table
from tests.bench.ttft_client import Cell, Sample
from tests.e2e.stack import monolithic_child
from tests.support.sealing import key_file


def test_ttft_pinned_monolithic_engine_runs_alone_on_core_0() -> None:
    child = pinned(monolithic_child(Path("/m")), "0")
    assert child.argv[:3] == ["taskset", "-c", "0"]
    assert child.env["VLLM_CPU_OMP_THREADS_BIND"] == "0"


def test_ttft_pinned_plan_puts_p_on_core_0_and_the_rest_on_core_1() -> None:
    plan = build_plan(LaunchOptions(model="/m", side_channel_secret_file=key_file()))
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


BURN = """
import sys, threading, time
def burn(s):
    end = time.thread_time() + s
    while time.thread_time() < end:
        pass
print("ready", flush=True)
sys.stdin.readline()
side = threading.Thread(target=burn, args=(0.1,))
side.start()
burn(0.4)
side.join()
print("done", flush=True)
sys.stdin.readline()
"""


def test_ttft_core_cpu_splits_the_busiest_thread_from_the_others_on_the_core() -> None:
    core = str(max(os.sched_getaffinity(0)))  # a CPU this process may use
    with subprocess.Popen(
        ["taskset", "-c", core, sys.executable, "-c", BURN],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    ) as proc:
        assert proc.stdin is not None and proc.stdout is not None
        try:
            assert proc.stdout.readline().strip() == "ready"
            before = corecpu.snapshot(core)
            assert proc.pid in before.processes  # found by its affinity
            assert os.getpid() not in before.processes  # this process may use any core
            proc.stdin.write("go\n")
            proc.stdin.flush()
            assert proc.stdout.readline().strip() == "done"
            used = corecpu.spent(before, corecpu.snapshot(core))
        finally:
            proc.kill()
    assert 0.35 <= used.forward_s < 1.0
    # the side thread has ended by then: it counts through its process's total
    assert 0.05 <= used.others_s < used.forward_s


def test_ttft_pinned_table_shows_core_cpu_and_d_ready_wait_per_cell() -> None:
    args = argparse.Namespace(flows=["concurrent", "decode-first"], sizes=[1024], runs=1,
                              pinned=True)  # fmt: skip
    sample = Sample(1024, 1.0, 1.1, 0.0, 1.1)
    cells = {
        (MONO, 1024): Cell(samples=[sample], core_cpu=corecpu.CoreCpu(0.9, 0.012)),
        ("concurrent", 1024): Cell(
            samples=[sample],
            phases=[[0.005, 0.003, 0.95, 0.02]],
            ready_wait_s=0.0026,
            core_cpu=corecpu.CoreCpu(0.91, 0.04),
        ),
    }
    text = table("tiny", args, cells)
    assert "| 1024 | concurrent | 5.0 | 3.0 | 950.0 | 20.0 | 2.6 |" in text
    assert "| 1024 | 900 / 12 | 910 / 40 | – |" in text  # decode-first did not run
    unpinned = table("tiny", argparse.Namespace(**{**vars(args), "pinned": False}), cells)
    assert "CPU on core" not in unpinned
