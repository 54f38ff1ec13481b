"""One process of the every-layout push over the real Mooncake TCP transport.

Both processes build one worker per ``KVCacheLayout`` member, with KV caches from vLLM's own
planner and allocator, all sharing one Mooncake engine. P's workers hold the same logical KV
(``logical_kv``) in their own layouts; P worker X pushes into every D worker Y, into D blocks
``X * SPAN + ...``, so all pairs land in one D process without overlapping.

    python -m tests.connector.layout_peer d --port N --out FILE [--d-tp 2]
        (D: TP ranks of a layout; layout i's rank r listens on N + i * d_tp + r)
    python -m tests.connector.layout_peer p --d-port N [--tp 2] [--d-tp 2]
        (P: TP ranks of a layout)
"""

from __future__ import annotations

import argparse
import sys
import time

import torch

from connector.config import ConnectorSettings
from connector.metadata import Destination, PdgateMetadata, RecvEntry, SendChunk
from connector.transport import Transport, make_transport
from connector.worker import ConnectorWorker
from tests.connector import peer_start
from tests.connector.vllm_kv import LAYOUTS as LAYOUTS
from tests.connector.vllm_kv import planned
from tests.support import kv_views
from tests.support.sealing import key_file

LAYERS = [f"model.layers.{i}.self_attn.attn" for i in range(3)]
HEADS, HEAD, BS = 2, 32, 16
SPAN = 4  # D blocks per P layout
BLOCKS = SPAN * len(LAYOUTS) + 2
# (P block, D block offset): a run, a reversed pair; chunk boundaries not on a power of two
CHUNKS = [[(0, 0), (1, 1), (2, 3)], [(3, 2)]]


def logical_kv(layer: int) -> torch.Tensor:
    """What every P worker holds in layer ``layer``, as ``[B, H, N, C]``."""
    g = torch.Generator().manual_seed(1000 + layer)
    return torch.randn((BLOCKS, HEADS, BS, 2 * HEAD), generator=g).half()


def tid(p_layout: str, d_layout: str) -> str:
    return f"t-{p_layout}-{d_layout}"


def _worker(
    role: str, port: int, layout: str, transport: Transport, rank: int = 0, tp: int = 1
) -> ConnectorWorker:
    settings = ConnectorSettings(
        side_channel_host="127.0.0.1",
        side_channel_port=port,
        transport="mooncake",
        mooncake_protocol="tcp",
        kv_load_timeout_s=60,
        handshake_timeout_s=5.0,
        side_channel_secret_file=key_file(),  # shared with the other peer (environment)
    )
    return ConnectorWorker(
        None,
        settings,
        rank=rank,
        tp_size=tp,
        engine_id=f"{role}-{layout}",
        total_kv_heads=HEADS,
        block_size=BS,
        role=role,
        transport=transport,
    )


def _caches(layout: str, heads: int = HEADS) -> dict[str, torch.Tensor]:
    return planned(layout, LAYERS, blocks=BLOCKS, heads=heads, head_size=HEAD, block_size=BS)


def run_d(a: argparse.Namespace) -> int:
    transport = make_transport("mooncake", "127.0.0.1", "tcp", "")
    workers: dict[tuple[str, int], ConnectorWorker] = {}  # (layout, rank)
    caches: dict[tuple[str, int], dict[str, torch.Tensor]] = {}
    per = HEADS // a.d_tp
    for i, layout in enumerate(LAYOUTS):
        recvs = [
            RecvEntry(
                f"d-{x}", tid(x, layout), [j * SPAN + d for chunk in CHUNKS for _, d in chunk]
            )
            for j, x in enumerate(LAYOUTS)
        ]
        for r in range(a.d_tp):
            key = (layout, r)
            caches[key] = _caches(layout, per)
            port = a.port + i * a.d_tp
            workers[key] = _worker("kv_consumer", port, layout, transport, r, a.d_tp)
            workers[key].register_kv_caches(caches[key])
            workers[key].start_step(PdgateMetadata(recvs=recvs))
    peer_start.ready(a)
    pending = {(key, f"d-{x}") for x in LAYOUTS for key in workers}
    failed: set[tuple[tuple[str, int], str]] = set()
    deadline = time.monotonic() + 90
    while pending and time.monotonic() < deadline:
        for key, w in workers.items():
            _, done, bad = w.transfer_results(set())
            pending -= {(key, r) for r in done}
            failed |= {(key, r) for r in bad}
        time.sleep(0.005)
    print(f"RECEIVED pending={len(pending)} failed={len(failed)}", flush=True)

    def heads(y: str, name: str, b: int) -> torch.Tensor:  # D's block b, all ranks' heads
        return torch.cat([kv_views.block(caches[(y, r)][name], b, BS) for r in range(a.d_tp)])

    torch.save(
        {
            (y, name): torch.stack([heads(y, name, b) for b in range(BLOCKS)])
            for y in LAYOUTS
            for name in LAYERS
        },
        a.out,
    )
    for w in workers.values():
        w.shutdown()
    return 0


def run_p(a: argparse.Namespace) -> int:
    peer_start.wait_for_d(a)
    transport = make_transport("mooncake", "127.0.0.1", "tcp", "")
    workers: list[ConnectorWorker] = []  # shut down at the end: they share one engine
    per = HEADS // a.tp
    for j, x in enumerate(LAYOUTS):
        ranks = [_worker("kv_producer", 1, x, transport, r, a.tp) for r in range(a.tp)]
        workers += ranks
        for r, w in enumerate(ranks):
            caches = _caches(x, per)
            for li, name in enumerate(LAYERS):
                caches[name].copy_(logical_kv(li)[:, r * per : (r + 1) * per])
            w.register_kv_caches(caches)
        for i, y in enumerate(LAYOUTS):
            port = a.d_port + i * a.d_tp
            dest = Destination(
                f"dec-{y}", f"kv_consumer-{y}", "127.0.0.1", port, a.d_tp, HEADS, False, BS
            )
            for k, chunk in enumerate(CHUNKS):
                pairs = [(p, j * SPAN + d) for p, d in chunk]
                send = SendChunk(f"p-{y}", tid(x, y), dest, pairs, k == len(CHUNKS) - 1)
                meta = PdgateMetadata(sends=[send])
                for w in ranks:
                    w.start_step(meta)
                    for name in LAYERS:
                        w.save_layer(meta, name)
                    w.end_step(meta)
        ids = {f"p-{y}" for y in LAYOUTS}
        for w in ranks:
            sent: set[str] = set()
            deadline = time.monotonic() + 60
            first = True
            while sent != ids and time.monotonic() < deadline:
                s, _, _ = w.transfer_results(ids if first else set())
                first = False
                sent |= s
                time.sleep(0.005)
            assert w.sender is not None
            print(f"SENT {x} rank {w.rank}: {len(sent)} writes={w.sender.writes}", flush=True)
    for w in workers:
        w.shutdown()
    return 0


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("role", choices=["d", "p"])
    ap.add_argument("--port", type=int, default=0)
    ap.add_argument("--d-port", type=int, default=0)
    ap.add_argument("--out", default="")
    ap.add_argument("--tp", type=int, default=1, help="P's TP size")
    ap.add_argument("--d-tp", type=int, default=1, help="D's TP size")
    peer_start.add_arguments(ap)
    a = ap.parse_args()
    return run_d(a) if a.role == "d" else run_p(a)


if __name__ == "__main__":
    sys.exit(main())
