"""P and D worker halves wired together on loopback, with CPU-layout KV tensors.

Each rank gets its slice of a global KV (heads split or replicated the way vLLM does), so a
test can compare D's blocks with the exact bytes P holds.
"""

from __future__ import annotations

import socket
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from connector.config import ConnectorSettings
from connector.metadata import Destination, PdgateMetadata, RecvEntry, SendChunk
from connector.tp import heads_of
from connector.tracing import ConnectorTracer
from connector.transport import InProcessTransport, Transport
from connector.worker import ConnectorWorker
from tests.support.sealing import key_file

LAYERS = [f"model.layers.{i}.self_attn.attn" for i in range(4)]


def free_port_range(n: int) -> int:
    for _ in range(200):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            base = int(s.getsockname()[1])
        if base + n > 65000:
            continue
        ok = True
        for p in range(base, base + n):
            with socket.socket() as t:
                try:
                    t.bind(("127.0.0.1", p))
                except OSError:
                    ok = False
                    break
        if ok:
            return base
    raise RuntimeError("no free port range")


@dataclass
class Instance:
    engine_id: str
    tp: int
    heads: int  # total KV heads (1 for MLA)
    mla: bool
    blocks: int
    block_size: int
    dim: int
    workers: list[ConnectorWorker] = field(default_factory=list)
    caches: list[dict[str, Any]] = field(default_factory=list)  # per rank: what it registered

    def local(self, rank: int) -> tuple[int, int]:
        return heads_of(rank, self.tp, self.heads)


def make_instance(
    engine_id: str,
    role: str,
    tp: int,
    *,
    heads: int = 8,
    mla: bool = False,
    blocks: int = 32,
    block_size: int = 16,
    dim: int = 32,
    port: int = 0,
    transport: str = "inprocess",
    transports: list[Transport] | None = None,
    timeout_s: float = 30.0,
    layers: list[str] | None = None,
    allocate: Callable[[int], dict[str, Any]] | None = None,
    device: str = "cpu",
    tracer: ConnectorTracer | None = None,
) -> Instance:
    """``allocate(local_heads)``: each rank's KV caches (default: zeroed CPU-layout tensors)."""
    inst = Instance(engine_id, tp, 1 if mla else heads, mla, blocks, block_size, dim)
    settings = ConnectorSettings(
        side_channel_host="127.0.0.1",
        side_channel_port=port or 5600,
        transport=transport,
        kv_load_timeout_s=timeout_s,
        handshake_timeout_s=2.0,
        device=device,
        side_channel_secret_file=key_file(),
    )
    for rank in range(tp):
        _, n = inst.local(rank)
        caches: dict[str, Any] = {}
        for name in layers or LAYERS:
            shape = (blocks, block_size, dim) if mla else (blocks, n, block_size, 2 * dim)
            caches[name] = torch.zeros(shape, dtype=torch.float32)
        if allocate is not None:
            caches = allocate(n)
        t = (
            transports[rank]
            if transports
            else (InProcessTransport() if transport == "inprocess" else None)
        )
        w = ConnectorWorker(
            None,
            settings,
            rank=rank,
            tp_size=tp,
            engine_id=engine_id,
            total_kv_heads=heads,
            use_mla=mla,
            block_size=block_size,
            role=role,
            transport=t,
            tracer=tracer,
        )
        w.register_kv_caches(caches)
        inst.workers.append(w)
        inst.caches.append(caches)
    return inst


def fill_prefill(p: Instance, seed: int = 0) -> dict[str, torch.Tensor]:
    """Random global KV, each P rank holding its heads; returns the global tensors per layer."""
    g = torch.Generator().manual_seed(seed)
    full: dict[str, torch.Tensor] = {}
    for name in p.caches[0]:
        if p.mla:
            full[name] = torch.randn((p.blocks, p.block_size, p.dim), generator=g)
        else:
            full[name] = torch.randn((p.blocks, p.heads, p.block_size, 2 * p.dim), generator=g)
        for rank, caches in enumerate(p.caches):
            if p.mla:
                caches[name].copy_(full[name])
            else:
                start, n = p.local(rank)
                caches[name].copy_(full[name][:, start : start + n])
    return full


def destination(d: Instance, port: int) -> Destination:
    return Destination(
        "dec", d.engine_id, "127.0.0.1", port, d.tp, None if d.mla else d.heads, d.mla, d.block_size
    )


def push(
    p: Instance,
    req_id: str,
    tid: str,
    dest: Destination,
    chunks: list[list[tuple[int, int]]],
    *,
    fail_last: str = "",
    final: bool = True,
    traceparent: str = "",
) -> None:
    """Run P's forward hooks for each chunk: every layer, then the step end (``final``: the
    last chunk ends the prefill)."""
    for i, pairs in enumerate(chunks):
        last = final and i == len(chunks) - 1
        meta = PdgateMetadata(
            sends=[
                SendChunk(req_id, tid, dest, pairs, last, fail_last if last else "", traceparent)
            ]
        )
        for w in p.workers:
            w.start_step(meta)
            for name in p.caches[0]:
                w.save_layer(meta, name)
            w.end_step(meta)


def expect(d: Instance, req_id: str, tid: str, block_ids: list[int], traceparent: str = "") -> None:
    meta = PdgateMetadata(recvs=[RecvEntry(req_id, tid, block_ids, 0, traceparent)])
    for w in d.workers:
        w.start_step(meta)
        w.end_step(meta)


def poll(
    inst: Instance, finished: set[str], until: Any, timeout: float = 20.0
) -> list[tuple[set[str], set[str], set[str]]]:
    """Poll every rank's results until ``until(results_so_far)``; returns per-rank unions."""
    acc: list[tuple[set[str], set[str], set[str]]] = [(set(), set(), set()) for _ in inst.workers]
    deadline = time.monotonic() + timeout
    first = True
    while time.monotonic() < deadline:
        for rank, w in enumerate(inst.workers):
            s, r, f = w.transfer_results(finished if first else set())
            acc[rank][0].update(s)
            acc[rank][1].update(r)
            acc[rank][2].update(f)
        first = False
        if until(acc):
            return acc
        time.sleep(0.01)
    raise AssertionError(f"condition not reached; got {acc}")


def small_push(p: Instance, d: Instance, port: int, tid: str) -> None:
    """One three-block push of request ``preq`` from a single-rank P into D's ``dreq``
    (blocks 1-3, over two chunks), polled until P's send and D's load both ended."""
    fill_prefill(p)
    expect(d, "dreq", tid, [1, 2, 3])
    push(p, "preq", tid, destination(d, port), [[(0, 1)], [(1, 2), (2, 3)]])
    poll(p, {"preq"}, lambda acc: "preq" in acc[0][0])
    poll(d, set(), lambda acc: "dreq" in acc[0][1])


def close(*instances: Instance) -> None:
    for inst in instances:
        for w in inst.workers:
            w.shutdown()
