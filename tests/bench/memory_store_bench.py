"""Memory store: what a binding write costs as live bindings pile up (the embedded store keeps
every binding for its TTL, 600 s by default: 300,000 of them at 500 requests/s, more
while finished ones are retained).

    .venv/bin/python tests/bench/memory_store_bench.py [--sizes 10000,100000,300000] [--writes N]

Two stores in the same run: ``MemoryStore`` as it is (a heap of expiries: a write drops what
is due and touches nothing else) and ``ScanSweep``, the same store with the sweep it had before
(every 512th write scans every binding for expired ones). For each number of live bindings,
microseconds per ``put_binding``, the median of ``--rounds`` rounds (each after ``gc.freeze()``, so
that neither store pays the other's garbage collections). Target: a write costs the
same at the largest size as at the smallest (within 1.5x).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import gc
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from metaserver.store.memory import MemoryStore
from metaserver.store.records import BindingPut, InstancePut
from pdwire.models import InstanceSpec
from tests.bench.metaserver_bench import INSTANCE, SPEC  # the same binding and instance

SCAN_EVERY = 512


class ScanSweep(MemoryStore):
    """The baseline: the sweep as it was, a scan of every binding every 512 writes."""

    def _sweep(self) -> None:
        self._writes += 1
        if self._writes % SCAN_EVERY:
            return
        now = self._clock()
        for key in [k for k, v in self._bindings.items() if v.expires <= now]:
            del self._bindings[key]
        for key in [k for k, v in self._instances.items() if v.expires <= now]:
            del self._instances[key]


async def _store(kind: type[MemoryStore]) -> MemoryStore:
    store = kind(binding_ttl_s=600, retain_s=900)
    spec = InstanceSpec.model_validate_json(INSTANCE)
    await store.put_instance(InstancePut.of("decode-0", spec, 1e6, spec_json=INSTANCE), time.time())
    return store


async def _fill(store: MemoryStore, put: BindingPut, prefix: str, n: int) -> float:
    """Write ``n`` new bindings; seconds taken."""
    now = time.time()
    t0 = time.perf_counter()
    for i in range(n):
        await store.put_binding(dataclasses.replace(put, transfer_id=f"{prefix}{i}"), now)
    return time.perf_counter() - t0


async def run(sizes: list[int], writes: int, rounds: int) -> dict[str, dict[int, float]]:
    put = BindingPut.of("t", SPEC, time.time())
    await _fill(await _store(MemoryStore), put, "warm-", writes)  # allocator and caches warm
    out: dict[str, dict[int, float]] = {}
    for kind in (MemoryStore, ScanSweep):
        store = await _store(kind)
        live = 0
        out[kind.__name__] = {}
        for size in sizes:
            if size > live:
                print(f"# {kind.__name__}: {size:,} live bindings", flush=True)
                await _fill(store, put, f"fill{size}-", size - live)
                live = size
            per_put = []
            for r in range(rounds):
                # what is already there is no round's garbage to collect: without this, the
                # first store measured pays the young heap's full collections
                gc.collect()
                gc.freeze()
                per_put.append(await _fill(store, put, f"m{size}-{r}-", writes) / writes * 1e6)
                live += writes
            out[kind.__name__][size] = statistics.median(per_put)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--sizes", default="10000,100000,300000", help="live bindings, comma-separated")
    ap.add_argument("--writes", type=int, default=10_000, help="writes measured per round")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--strict", action="store_true", help="exit 1 when the target is missed")
    args = ap.parse_args()
    sizes = sorted(int(s) for s in args.sizes.split(",") if s)
    if not sizes or args.writes <= 0 or args.rounds <= 0:
        ap.error("--sizes, --writes and --rounds must be positive")
    res = asyncio.run(run(sizes, args.writes, args.rounds))
    heap, scan = res["MemoryStore"], res["ScanSweep"]
    print("\n| live bindings | µs per write (heap sweep) | µs per write (scan sweep, before) |")
    print("|---:|---:|---:|")
    for size in sizes:
        print(f"| {size:,} | {heap[size]:.2f} | {scan[size]:.2f} |")
    growth = heap[sizes[-1]] / heap[sizes[0]]
    ok = growth <= 1.5
    print(
        f"write cost at {sizes[-1]:,} vs {sizes[0]:,} live bindings: {growth:.2f}x "
        f"(before: {scan[sizes[-1]] / scan[sizes[0]]:.2f}x; target <= 1.5x) "
        f"-> {'ok' if ok else 'below target'}"
    )
    if args.strict and not ok:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
