"""Per device (cpu, cuda, npu): the transfer protocol, vLLM's extra flags and environment, and
which devices each engine sees."""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from launch.options import Device


@dataclass(frozen=True)
class DevicePreset:
    protocol: str
    flags: tuple[str, ...] = ()
    env: dict[str, str] = field(default_factory=dict)
    # the variable that gives each engine its own devices ("" = engines share the host)
    visible_devices_env: str = ""


# Per device: transfer-engine protocol and extra vLLM flags/environment.
DEVICES = {
    "cpu": DevicePreset(
        "tcp",
        ("--gpu-memory-utilization", "0.1", "--dtype", "float32"),
        # the engines share the host's cores: unbound OpenMP threads, and none of them
        # spinning at a barrier while another engine (or the metaserver) needs the core; nor
        # in vLLM's queues between the engine core and its TP workers (connector/shm_wait.py)
        {
            "VLLM_CPU_KVCACHE_SPACE": "1",
            "VLLM_CPU_OMP_THREADS_BIND": "nobind",
            "OMP_WAIT_POLICY": "PASSIVE",
            "PDGATE_SHM_WAIT_S": "0.0002",
        },
    ),
    "cuda": DevicePreset("rdma", visible_devices_env="CUDA_VISIBLE_DEVICES"),
    "npu": DevicePreset("ascend", visible_devices_env="ASCEND_RT_VISIBLE_DEVICES"),
}

# vllm-cpu gives even a single-rank engine's model worker a process of its own ("mp" executor)
# unless VLLM_ENABLE_V1_MULTIPROCESSING=0 (vllm/platforms/cpu.py), and each process it starts
# imports vLLM and torch afresh ("spawn"). With the variable the worker runs inside the engine
# core's process ("uni" executor); the API server still runs the engine core apart. One engine
# alone here answered /health after 85 s against 131 s (docs/development.md).
CPU_SINGLE_PROCESS_WORKER = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}


def device_env(device: Device, first: int, count: int) -> dict[str, str]:
    """One engine's devices: ``count`` of them from index ``first`` of the visible list (the
    parent's ``CUDA_VISIBLE_DEVICES`` / ``ASCEND_RT_VISIBLE_DEVICES`` when set, else 0, 1, …)."""
    var = DEVICES[device].visible_devices_env
    if not var:
        return {}
    visible = [d.strip() for d in os.environ.get(var, "").split(",") if d.strip()]
    if visible and first + count > len(visible):
        raise ValueError(f"{var}={','.join(visible)} has too few devices: need {first + count}")
    ids = (
        visible[first : first + count] if visible else [str(i) for i in range(first, first + count)]
    )
    return {var: ",".join(ids)}
