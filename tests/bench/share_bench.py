"""What ``--share-load`` costs a choice: the read of the other replicas' load before it
(``GET /v1/load/{replica}``) and the report after it (``PUT``), through a real pd-metaserver
(its memory board, and its Redis board on a private redis-server with ``appendfsync always``,
as docs/metaserver.md recommends), with the proxy's own client and snapshot (``LoadShare``).

    .venv/bin/python tests/bench/share_bench.py [--replicas 2,8] [--instances 8] [--seconds 3]

Per store and number of replicas (each reporting load on every instance):
- one replica at a time, interleaved: the read (what a choice waits for: ``fresh``), the
  report (sent after the choice; nobody waits for it), and a bare ``GET /health`` through the
  same connection pool (the baseline);
- every replica sending requests' traffic back to back, each request a read and three reports
  (its choice, P's release, D's release): requests/s and the metaserver's CPU per request. An
  upper bound on the cost: under load a replica's reports coalesce (one in flight) and
  simultaneous choices share a read.

Target (docs/benchmarks.md): the read adds at most 1 ms to the bare round trip (median).
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

import aiohttp  # noqa: E402
import uvloop  # noqa: E402

from pdwire.client import AsyncMetaserverClient, RetryPolicy  # noqa: E402
from proxy.instances import Registry, Role  # noqa: E402
from proxy.instances.share import LoadShare  # noqa: E402
from tests.bench.httpload import Latencies  # noqa: E402
from tests.bench.metaserver_bench import cpu_seconds  # noqa: E402
from tests.support.procs import VENV_BIN, Process, free_port, wait_http  # noqa: E402
from tests.support.services import RedisServer  # noqa: E402


def registry(instances: int, seed: int) -> Registry:
    """A replica's registry: half P, half D, every one with requests in flight."""
    reg = Registry()
    half = max(instances // 2, 1)
    reg.reconcile(Role.PREFILL, [f"http://10.0.0.{i}:8100" for i in range(half)])
    reg.reconcile(Role.DECODE, [f"http://10.0.1.{i}:8200" for i in range(half)])
    for n, inst in enumerate(reg.instances()):
        for _ in range(1 + (n + seed) % 3):
            inst.acquire(512 * (1 + n % 4))
    return reg


async def measure(base: str, a: argparse.Namespace, replicas: int) -> dict[str, float]:
    async with aiohttp.ClientSession() as session:
        shares = [
            LoadShare(
                registry(a.instances, r),
                AsyncMetaserverClient(
                    base, session=session, timeout_s=1.0, retry=RetryPolicy(retries=0)
                ),
                f"bench-{replicas}-{r}",
                0.1,
            )
            for r in range(replicas)
        ]
        for _ in range(20):  # connections open, every replica on the board
            for s in shares:
                await s.once()
        assert all(s.replicas == replicas for s in shares), [s.replicas for s in shares]
        read, report, bare = Latencies(), Latencies(), Latencies()
        for i in range(a.samples):  # interleaved, so a pause of the machine hits all three
            s = shares[i % replicas]
            t = time.perf_counter()
            await s.look()
            read.add(time.perf_counter() - t, 200)
            t = time.perf_counter()
            await s.once()
            report.add(time.perf_counter() - t, 200)
            t = time.perf_counter()
            async with session.get(f"{base}/health") as resp:
                await resp.read()
            bare.add(time.perf_counter() - t, resp.status)
        failures = sum(s.failures for s in shares)

        stop = time.monotonic() + a.seconds
        done = 0

        async def burst(s: LoadShare) -> None:
            nonlocal done
            while time.monotonic() < stop:
                await s.look()
                for _ in range(3):
                    await s.once()
                done += 1

        cpu0, t0 = cpu_seconds(a.metaserver_pid), time.perf_counter()
        await asyncio.gather(*(burst(s) for s in shares))
        elapsed, cpu = time.perf_counter() - t0, cpu_seconds(a.metaserver_pid) - cpu0
        failures += sum(s.failures for s in shares)
    if failures or set(bare.statuses) != {200}:
        raise SystemExit(f"{failures} exchanges failed; /health answered {bare.statuses}")
    return {
        "read_p50": read.pct(0.5),
        "read_p99": read.pct(0.99),
        "report_p50": report.pct(0.5),
        "report_p99": report.pct(0.99),
        "bare_p50": bare.pct(0.5),
        "bare_p99": bare.pct(0.99),
        "rate": done / elapsed,
        "cpu_us": cpu / done * 1e6,
    }


def metaserver(port: int, store: str | None, namespace: str, work: Path) -> Process:
    args = [str(VENV_BIN / "pd-metaserver"), "--port", str(port), "--log-level", "warning"]
    if store is not None:
        args += ["--store", store, "--namespace", namespace]
    return Process(args, log=work / f"metaserver-{port}.log")


async def run(a: argparse.Namespace) -> int:
    work = Path(tempfile.mkdtemp(prefix="share-bench-"))
    redis = RedisServer(work)
    redis.start()
    rows = []
    try:
        for store_name, store in (("memory", None), ("redis", redis.url)):
            for n in a.replicas:  # a metaserver each: the last row's reports have not lapsed
                port = free_port()
                server = metaserver(port, store, f"bench{n}", work)
                try:
                    wait_http(f"http://127.0.0.1:{port}/ready", proc=server)
                    a.metaserver_pid = server.pid
                    rows.append((store_name, n, await measure(f"http://127.0.0.1:{port}", a, n)))
                    print(f"  {store_name}, {n} replicas: done", file=sys.stderr, flush=True)
                finally:
                    server.stop()
    finally:
        redis.stop()

    print(
        f"\nshared load: {a.instances} instances per report; {a.samples} reads and reports "
        f"(p50/p99 ms), then {a.seconds:.0f} s of every replica sending requests' traffic back "
        "to back (a read and three reports each)\n"
    )
    print(
        "| store | replicas | read (before a choice) | report (after) | bare GET | read added "
        "| requests/s, all busy | metaserver CPU µs/request |"
    )
    print("|---|--:|--:|--:|--:|--:|--:|--:|")
    worst = 0.0
    for store_name, n, m in rows:
        added = m["read_p50"] - m["bare_p50"]
        worst = max(worst, added)
        print(
            f"| {store_name} | {n} | {m['read_p50']:.2f} / {m['read_p99']:.2f} "
            f"| {m['report_p50']:.2f} / {m['report_p99']:.2f} "
            f"| {m['bare_p50']:.2f} / {m['bare_p99']:.2f} | {added:+.2f} "
            f"| {m['rate']:,.0f} | {m['cpu_us']:,.0f} |"
        )
    ok = worst <= 1.0
    print(
        f"\nthe read over a bare round trip, median, worst row: {worst:+.2f} ms "
        f"(target <= 1 ms: {'PASS' if ok else 'FAIL'})"
    )
    return 0 if ok or not a.strict else 1


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--replicas", type=lambda s: [int(x) for x in s.split(",")], default=[2, 8])
    p.add_argument("--instances", type=int, default=8, help="instances in every report")
    p.add_argument("--samples", type=int, default=400, help="single exchanges per row")
    p.add_argument("--seconds", type=float, default=3.0, help="the all-busy phase, per row")
    p.add_argument("--strict", action="store_true", help="exit 1 when the target is missed")
    sys.exit(uvloop.run(run(p.parse_args())))


if __name__ == "__main__":
    main()
