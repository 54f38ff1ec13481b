"""One side of a two-process push over the real Mooncake TCP transport (used by the tests and
the benchmark). KV caches are allocated by vLLM's own ``allocate_kv_cache`` (CPU layout).

    python -m tests.connector.mooncake_peer d --port N --tid T --dst 3,4,5 --out FILE
    python -m tests.connector.mooncake_peer p --d-port N --tid T --chunks "0:3,1:4;2:5"

Several transfers in one pair of processes (one after the other): ``--tid T1,T2`` on both,
D's ``--dst`` per transfer separated by ``/``, P's ``--chunks`` likewise.
"""

from __future__ import annotations

import argparse
import sys
import time

import torch

from connector.config import ConnectorSettings
from connector.metadata import Destination, PdgateMetadata, RecvEntry, SendChunk
from connector.worker import ConnectorWorker
from tests.connector import peer_start
from tests.support.sealing import key_file

LAYERS = [f"model.layers.{i}.self_attn.attn" for i in range(4)]


def allocate(
    num_blocks: int, heads: int, block_size: int, head: int, layers: list[str]
) -> dict[str, torch.Tensor]:
    from vllm.v1.kv_cache_interface import (
        FullAttentionSpec,
        KVCacheConfig,
        KVCacheGroupSpec,
        KVCacheTensor,
    )
    from vllm.v1.kv_cache_layout import KVCacheLayout
    from vllm.v1.worker.utils import allocate_kv_cache

    spec = FullAttentionSpec(
        block_size=block_size, num_kv_heads=heads, head_size=head, dtype=torch.float32
    )
    page = spec.page_size_bytes
    tensor = KVCacheTensor(
        size=page * num_blocks * len(layers),
        layers=layers,
        layer_stride=page * num_blocks,
        block_stride=page,
    )
    cfg = KVCacheConfig(
        num_blocks=num_blocks,
        kv_cache_tensors=[tensor],
        kv_cache_groups=[KVCacheGroupSpec(layers, spec)],
    )
    caches: dict[str, torch.Tensor] = allocate_kv_cache(
        cfg, torch.device("cpu"), KVCacheLayout.LBHNC
    )
    return caches


def expected(seed: int, shape: tuple[int, ...], layers: list[str]) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {name: torch.randn(shape, generator=g) for name in layers}


def worker(role: str, port: int, engine: str, timeout: float) -> ConnectorWorker:
    settings = ConnectorSettings(
        side_channel_host="127.0.0.1",
        side_channel_port=port,
        transport="mooncake",
        mooncake_protocol="tcp",
        kv_load_timeout_s=timeout,
        handshake_timeout_s=5.0,
        side_channel_secret_file=key_file(),  # shared with the other peer (environment)
    )
    return ConnectorWorker(
        None, settings, rank=0, tp_size=1, engine_id=engine, total_kv_heads=2, role=role
    )


def run_d(a: argparse.Namespace) -> int:
    w = worker("kv_consumer", a.port, "d-engine", a.timeout)
    caches = allocate(a.blocks, 2, a.block_size, a.head, LAYERS)
    w.register_kv_caches(caches)
    peer_start.ready(a)
    tids = a.tid.split(",")
    dsts = [[int(x) for x in d.split(",")] for d in a.dst.split("/")]
    reqs = [f"dreq{i}" for i in range(len(tids))]
    meta = PdgateMetadata(
        recvs=[RecvEntry(r, t, d) for r, t, d in zip(reqs, tids, dsts, strict=True)]
    )
    w.start_step(meta)
    t0 = time.monotonic()
    done: set[str] = set()
    failed: set[str] = set()
    while not done.issuperset(reqs):
        _, r, f = w.transfer_results(set())
        done |= r
        failed |= f
        time.sleep(0.002)
    print(f"RECEIVED {'failed' if failed else 'ok'} {time.monotonic() - t0:.3f}s", flush=True)
    if a.out:
        torch.save({k: v.clone() for k, v in caches.items()}, a.out)
    w.shutdown()
    return 0


def run_p(a: argparse.Namespace) -> int:
    w = worker("kv_producer", 1, "p-engine", a.timeout)
    caches = allocate(a.blocks, 2, a.block_size, a.head, LAYERS)
    w.register_kv_caches(caches)
    for name, value in expected(a.seed, tuple(caches[LAYERS[0]].shape), LAYERS).items():
        caches[name].copy_(value)
    print("STARTED", flush=True)  # imports (vLLM's take 20-30 s on a busy 2-core machine) done
    peer_start.wait_for_d(a)
    dest = Destination("dec", "d-engine", "127.0.0.1", a.d_port, 1, 2, False, a.block_size)
    t0 = time.monotonic()
    for n, (tid, spec) in enumerate(zip(a.tid.split(","), a.chunks.split("/"), strict=True)):
        _push(w, f"preq{n}", tid, dest, spec)
    assert w.sender is not None
    tr_bytes = w.sender.writes
    print(f"SENT {time.monotonic() - t0:.3f}s writes={tr_bytes}", flush=True)
    w.shutdown()
    return 0


def _push(w: ConnectorWorker, req: str, tid: str, dest: Destination, spec: str) -> None:
    """One transfer, chunk by chunk and layer by layer; returns once it is sent."""
    chunks = [
        [(int(x.split(":")[0]), int(x.split(":")[1])) for x in c.split(",") if x]
        for c in spec.split(";")
    ]
    for i, pairs in enumerate(chunks):
        meta = PdgateMetadata(sends=[SendChunk(req, tid, dest, pairs, i == len(chunks) - 1, "")])
        w.start_step(meta)
        for name in LAYERS:
            w.save_layer(meta, name)
        w.end_step(meta)
    sent: set[str] = set()
    first = True
    while req not in sent:
        s, _, _ = w.transfer_results({req} if first else set())
        first = False
        sent |= s
        time.sleep(0.002)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("role", choices=["d", "p"])
    ap.add_argument("--port", type=int, default=0)
    ap.add_argument("--d-port", type=int, default=0)
    ap.add_argument("--tid", required=True)
    ap.add_argument("--dst", default="")
    ap.add_argument("--chunks", default="")
    ap.add_argument("--out", default="")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--blocks", type=int, default=32)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--head", type=int, default=64)
    ap.add_argument("--timeout", type=float, default=30.0)
    peer_start.add_arguments(ap)
    a = ap.parse_args()
    return run_d(a) if a.role == "d" else run_p(a)


if __name__ == "__main__":
    sys.exit(main())
