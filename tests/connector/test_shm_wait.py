"""``PDGATE_SHM_WAIT_S``: vLLM's shared-memory message queue (engine core <-> TP workers) waits
by sleeping, not by spinning on ``sched_yield`` (connector/shm_wait.py). Checked on vLLM's real
queue: a writer and a reader in this process, the reader waiting right after a read (vLLM's
busy window, where it spins) for a message that does not come."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from vllm.distributed.device_communicators import shm_broadcast

from connector import shm_wait
from launch.plan import build_plan
from tests.e2e.stack import base_options

WAIT_S = 0.3  # how long the reader waits for the message that does not come


@pytest.fixture
def queue(monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[Any, Any]]:
    """A writer and its one local reader, ready; vLLM's own wait restored afterwards."""
    monkeypatch.setattr(shm_broadcast, "sched_yield", vars(shm_broadcast)["sched_yield"])
    writer = shm_broadcast.MessageQueue(1, 1, max_chunk_bytes=1 << 16, max_chunks=4)
    readers: list[Any] = []

    def reader_side() -> None:
        reader = shm_broadcast.MessageQueue.create_from_handle(writer.export_handle(), 0)
        reader.wait_until_ready()
        readers.append(reader)

    t = threading.Thread(target=reader_side)
    t.start()
    writer.wait_until_ready()
    t.join(30)
    assert readers, "the reader did not connect"
    yield writer, readers[0]
    readers[0].shutdown()


def yields_while_waiting(
    writer: Any, reader: Any, monkeypatch: pytest.MonkeyPatch
) -> tuple[int, float]:
    """Read one message, then wait ``WAIT_S`` for one that never comes: the number of
    ``sched_yield`` calls meanwhile and the CPU seconds the waiting thread used."""
    writer.enqueue("step")
    assert reader.dequeue(timeout=5) == "step"
    calls = [0]
    real = os.sched_yield

    def counted() -> None:
        calls[0] += 1
        real()

    monkeypatch.setattr(os, "sched_yield", counted)
    cpu0 = time.thread_time()
    with pytest.raises(TimeoutError):
        reader.dequeue(timeout=WAIT_S)
    cpu = time.thread_time() - cpu0
    monkeypatch.setattr(os, "sched_yield", real)
    return calls[0], cpu


def test_shm_queue_spins_without_the_setting(
    queue: tuple[Any, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The premise: vLLM's own wait in the busy window is a ``sched_yield`` loop."""
    writer, reader = queue
    assert shm_wait.install({}) is None
    calls, _ = yields_while_waiting(writer, reader, monkeypatch)
    assert calls > 100


def test_shm_queue_sleeps_with_the_setting(
    queue: tuple[Any, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    writer, reader = queue
    assert shm_wait.install({shm_wait.ENV: "0.0002"}) == 0.0002
    calls, cpu = yields_while_waiting(writer, reader, monkeypatch)
    assert calls == 0
    # ~1,000 naps of 0.2 ms (plus timer slack) in 0.3 s: a few percent of a core, where the
    # spinning wait takes what the scheduler gives it
    assert cpu < WAIT_S / 3
    # and a message still gets through while it naps
    writer.enqueue("next")
    assert reader.dequeue(timeout=5) == "next"


@pytest.mark.parametrize("raw", ["0", "-1", "0.5", "soon"])
def test_shm_wait_refuses_a_sleep_out_of_range(raw: str) -> None:
    with pytest.raises(ValueError):
        shm_wait.wait_s_from({shm_wait.ENV: raw})


def test_cpu_preset_engines_sleep_in_the_shm_queue(tiny_model: Path) -> None:
    """pd-launch's cpu engines (the suite's, the demo's) get the setting, TP 2 ones included;
    GPU engines keep vLLM's spinning wait (their host's cores are not what the steps run on)."""
    plan = build_plan(base_options(tiny_model, tp_prefill=2))
    engines = [c for c in plan.children if c.kind == "engine"]
    assert engines
    for child in engines:
        assert shm_wait.wait_s_from(child.env) == 0.0002
    gpu = build_plan(base_options(tiny_model, device="cuda", tp_prefill=2))
    assert all(shm_wait.ENV not in c.env for c in gpu.children)
