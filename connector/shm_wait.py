"""Waits in vLLM's shared-memory message queue that sleep instead of spinning.

An engine with tensor parallelism > 1 runs its ranks in worker processes of their own, and the
engine core talks to them through vLLM's shared-memory ring
(``vllm/distributed/device_communicators/shm_broadcast.py``, vLLM 0.23-0.33 alike): each step
goes out to every worker on one ring and each worker's answer comes back on another. A reader
that read within the last second waits for the next message by calling ``sched_yield()`` in a
loop, and a writer whose ring is full does the same. So while the engine has work, the engine
core spins through every forward pass of its workers, and each worker spins between steps (on
D, vLLM steps every millisecond while a prompt's KV is still arriving). On a GPU host those are
CPU cores nobody else needs. On a CPU host they are the cores the forward passes, the other
engines and everything else run on: a P with TP 2 on 2 cores kept both its workers' main
threads at 61 % and 52 % of a core under light load (2026-11-29), and ``sched_yield`` gives
the core only to other threads of the engine's own scheduling group (a session, with the
kernel's autogroups on), never to another session's.

With ``PDGATE_SHM_WAIT_S`` set (pd-launch's ``cpu`` preset sets it), :func:`install` makes each
of those waits sleep that long instead: the thread leaves the core to whatever else is runnable,
and a message is seen at most that much later. Waits of an idle queue are unchanged (vLLM's
own: a socket poll). Installed in every process that builds ``PdgateConnector`` (the engine core
and each worker), which are the processes that hold these queues.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Mapping

ENV = "PDGATE_SHM_WAIT_S"

log = logging.getLogger("pdgate.shm_wait")


def wait_s_from(environ: Mapping[str, str]) -> float | None:
    """The sleep ``environ`` asks for (seconds), or None when unset or empty."""
    raw = environ.get(ENV, "").strip()
    if not raw:
        return None
    wait_s = float(raw)
    if not 0 < wait_s <= 0.01:
        raise ValueError(f"{ENV}={raw}: a sleep of more than 0 and at most 0.01 s")
    return wait_s


def sleeper(wait_s: float) -> Callable[[], None]:
    def nap() -> None:
        time.sleep(wait_s)

    nap.__qualname__ = f"pdgate_shm_wait({wait_s})"
    return nap


def install(environ: Mapping[str, str] = os.environ) -> float | None:
    """Make vLLM's shared-memory queue sleep ``PDGATE_SHM_WAIT_S`` per wait instead of
    yielding the CPU in a loop; returns the sleep, or None when the variable is unset."""
    wait_s = wait_s_from(environ)
    if wait_s is None:
        return None
    from vllm.distributed.device_communicators import shm_broadcast

    if not callable(getattr(shm_broadcast, "sched_yield", None)):
        log.warning("%s is set, but this vLLM's shared-memory queue has no sched_yield", ENV)
        return None
    shm_broadcast.sched_yield = sleeper(wait_s)  # type: ignore[attr-defined]  # imported there
    log.info("vLLM's shared-memory queue waits sleep %.0f us (%s)", wait_s * 1e6, ENV)
    return wait_s
