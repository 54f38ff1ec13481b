"""The KV-event index's memory and match time: the metaserver's memory index and its Redis
index (a private redis-server), filled with ``--blocks`` entries per instance.

    .venv/bin/python tests/bench/kv_index_bench.py [--instances 4] [--blocks 250000]

Memory: the Python heap the memory index holds (tracemalloc), and what Redis's
``used_memory`` grew by, per entry. Match: the median time of one ``match`` of a 64-block
prompt against every instance (what ``POST /v1/kv/match`` does per request; the prompt placed
on one of them, as a proxy does), the same reading the engines' events only (``placed:
false``), and the median of a Redis ``PING`` in the same run (the round trip any Redis call
pays).
"""

from __future__ import annotations

import argparse
import asyncio
import random
import sys
import tempfile
import tracemalloc
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

import redis.asyncio as aioredis  # noqa: E402

from metaserver.kvindex import Change, MemoryKVIndex, Op, Placement  # noqa: E402
from metaserver.kvindex.redis_index import RedisKVIndex  # noqa: E402
from tests.bench.timing import amedian_s  # noqa: E402
from tests.support.services import RedisServer  # noqa: E402

BATCH = 1000  # keys per applied event batch (a big prefill's BlockStored)


async def fill(index: MemoryKVIndex | RedisKVIndex, instances: int, blocks: int) -> list[int]:
    rng = random.Random(3)
    sample: list[int] = []
    for i in range(instances):
        keys = [rng.getrandbits(64) for _ in range(blocks)]
        if i == 0:
            sample = keys[:64]
        for start in range(0, blocks, BATCH):
            await index.apply(f"engine-{i}", [Change(Op.STORE, keys[start : start + BATCH])])
    return sample


async def run(a: argparse.Namespace) -> str:
    entries = a.instances * a.blocks
    ids = [f"engine-{i}" for i in range(a.instances)]
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    mem = MemoryKVIndex()
    sample = await fill(mem, a.instances, a.blocks)
    mem_bytes = tracemalloc.get_traced_memory()[0] - before
    tracemalloc.stop()
    await mem.place([Placement(ids[-1], sample)])  # a proxy's placement, read beside the events
    mem_match = await amedian_s(lambda: mem.match(sample, ids), a.repeat)
    mem_events = await amedian_s(lambda: mem.match(sample, ids, placed=False), a.repeat)

    server = RedisServer(Path(tempfile.mkdtemp(prefix="pdgate-kvindex-")))
    server.start()
    try:
        r = aioredis.Redis.from_url(server.url)
        base = int((await r.info("memory"))["used_memory"])
        red = RedisKVIndex(r, "bench", max_blocks=max(a.blocks, 1))
        await fill(red, a.instances, a.blocks)
        red_bytes = int((await r.info("memory"))["used_memory"]) - base
        await red.place([Placement(ids[-1], sample)])
        red_match = await amedian_s(lambda: red.match(sample, ids), a.repeat)
        red_events = await amedian_s(lambda: red.match(sample, ids, placed=False), a.repeat)
        ping = await amedian_s(r.ping, a.repeat)
        await r.aclose()
    finally:
        server.stop()
    assert (await mem.match(sample, ids))["engine-0"] == 64
    return "\n".join(
        [
            f"{a.instances} instances x {a.blocks:,} blocks = {entries:,} entries; "
            f"match: a 64-block prompt against every instance, median of {a.repeat}",
            "",
            "| index | bytes per entry | total MiB | match µs | events only µs "
            "| Redis PING µs (same run) |",
            "|---|--:|--:|--:|--:|--:|",
            f"| memory | {mem_bytes / entries:.0f} | {mem_bytes / 2**20:.0f} | "
            f"{mem_match * 1e6:.0f} | {mem_events * 1e6:.0f} | – |",
            f"| redis | {red_bytes / entries:.0f} | {red_bytes / 2**20:.0f} | "
            f"{red_match * 1e6:.0f} | {red_events * 1e6:.0f} | {ping * 1e6:.0f} |",
        ]
    )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--instances", type=int, default=4)
    p.add_argument("--blocks", type=int, default=250_000)
    p.add_argument("--repeat", type=int, default=300)
    print(asyncio.run(run(p.parse_args(argv))))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
