"""Proxy benchmark: pdgate against sglang-router and vllm-router on the same fake backends.

Everything runs in separate processes on loopback: the fake vLLM servers (tests/fakes), the
metaserver, each router in turn, and the load generator (this file with ``--loadgen``, so the
client never shares a process with a router). Per target and mode (non-streaming, streaming):
req/s, p50, p99 over a fixed window after a warm-up, 64 connections, 16-token answers.

Targets:
  direct-D          the load generator straight to the fake D (the ceiling of the setup)
  pdgate            prefill-first relay, round_robin (what the Rust routers do in PD mode)
  sglang-router     --pd-disaggregation, round_robin (P and D sent concurrently)
  vllm-router       --vllm-pd-disaggregation, round_robin (P first, then D)
  pdgate-decode-first  D first, binding through the real metaserver, P told by the binding
                    (the fakes' metaserver writes batched, and P's done signals on one open
                    channel per D, as the connector does; ``--per-call`` adds
                    pdgate-decode-first@per-call, each write and signal a request of its own)
  floor-relay, echo-lean, echo-asgi  (``--floor``) lower bounds from ``floor_relay.py``: the
                    prefill-first relay as bare callbacks (what the same work costs a Python
                    process with no framework), and a fixed answer from a bare httptools
                    protocol and from uvicorn's ASGI cycle (what that cycle costs per request)
  ascend-example    vllm-ascend's example layerwise proxy (``--ascend-example PATH``: a copy
                    of examples/disaggregated_prefill_v1/load_balance_proxy_layerwise_server_
                    example.py kept outside the repo), on fakes of vllm-ascend's D and P
  pdgate-ascend-layerwise  --flow ascend-layerwise on the same fakes (``--ascend`` or
                    ``--ascend-example``), D posting to the real metaserver

    .venv/bin/python tests/bench/proxy_bench.py [--seconds 10] [--connections 64] [--fakes N]
    .venv/bin/python tests/bench/proxy_bench.py --ascend-example /tmp/x/example.py \
        --only ascend-example,pdgate-ascend-layerwise

The example imports ``vllm.logger`` (vLLM is in the venv) and one constant from
``vllm_ascend`` (``BATCH_KV_TRANSFER_PARAMS``), which the bench provides as a one-line shim
package on the example's PYTHONPATH; fastapi, httpx and uvicorn come from the venv.

``--fakes N`` starts N fake P and N fake D instances (every router gets all of them;
direct-D uses the first D). ``--tracing`` adds ``pdgate@traced`` and
``pdgate-decode-first@traced``: the same with ``--otlp-traces-endpoint`` set, every request
sampled, spans exported over OTLP/HTTP to a receiver process (``tests/support/otlp.py``) that
decodes them.

``--store redis`` runs the metaserver on a redis-server the bench starts (counted as "redis"
among the other processes' CPU), ``--metaserver-workers N`` with N metaserver processes on its
port.

``--rate R`` paces the load generator to R req/s for every target (default: as fast as the
connections go). Without it a faster target batches more requests per event-loop turn, which
lowers its CPU per request; at one rate the CPU figures compare the work per request. The CPU
per request is the process group's user + system time over the whole window (warm-up
included) divided by the requests sent in it.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from tests.bench.corecpu import cpu_ticks, stat_fields  # noqa: E402
from tests.fakes.vllm import Knobs  # noqa: E402
from tests.support.procs import Process, free_port, wait_http  # noqa: E402

BIN = Path(sys.executable).parent
FLOOR = ("floor-relay", "echo-lean", "echo-asgi")
PROMPT = "Benchmark prompt about prefill and decode disaggregation. " * 4


# ---- load generator (runs in its own process) -----------------------------------------------
async def _loadgen(
    url: str,
    conns: int,
    seconds: float,
    warmup: float,
    stream: bool,
    rate: float | None,
    greedy: bool = False,
) -> None:
    """``rate``: each connection sends on its own schedule so that together they offer this
    many req/s (a connection whose answer comes late sends its next request at once);
    ``greedy``: ``temperature`` 0 (the proxy then compares P's and D's first tokens)."""
    import aiohttp

    req: dict[str, Any] = {"model": "fake-model", "prompt": PROMPT, "max_tokens": 16}
    req["stream"] = stream
    if greedy:
        req["temperature"] = 0
    body = json.dumps(req).encode()
    headers = {"content-type": "application/json"}
    lat: list[float] = []
    errors = sent = 0
    t_start = time.perf_counter()
    t_measure = t_start + warmup
    t_end = t_measure + seconds
    connector = aiohttp.TCPConnector(limit=conns, force_close=False)
    timeout = aiohttp.ClientTimeout(total=30)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:

        async def worker(k: int) -> None:
            nonlocal errors, sent
            next_at = t_start + k / rate if rate else 0.0
            while True:
                if rate:
                    if (wait := next_at - time.perf_counter()) > 0:
                        await asyncio.sleep(wait)
                    next_at += conns / rate
                t0 = time.perf_counter()
                if t0 >= t_end:
                    return
                sent += 1
                try:
                    async with session.post(url, data=body, headers=headers) as resp:
                        if stream:
                            async for _ in resp.content.iter_any():
                                pass
                        else:
                            await resp.read()
                        ok = resp.status == 200
                except (aiohttp.ClientError, TimeoutError):
                    ok = False
                t1 = time.perf_counter()
                if t0 >= t_measure and t1 <= t_end:
                    if ok:
                        lat.append(t1 - t0)
                    else:
                        errors += 1

        await asyncio.gather(*(worker(k) for k in range(conns)))
    lat.sort()

    def pct(p: float) -> float:
        return lat[min(len(lat) - 1, int(p * len(lat)))] * 1000 if lat else float("nan")

    print(
        json.dumps(
            {
                "rps": len(lat) / seconds,
                "p50": pct(0.50),
                "p99": pct(0.99),
                "errors": errors,
                "sent": sent,  # warm-up included: what the CPU totals are divided by
            }
        )
    )


def run_loadgen(url: str, args: argparse.Namespace, stream: bool) -> dict[str, Any]:
    argv = [sys.executable, __file__, "--loadgen", url, "--connections", str(args.connections)]
    argv += ["--seconds", str(args.seconds), "--warmup", str(args.warmup)]
    if args.rate:
        argv += ["--rate", str(args.rate)]
    if stream:
        argv.append("--stream")
    if args.greedy:
        argv.append("--greedy")
    out = subprocess.run(argv, capture_output=True, text=True, timeout=args.seconds + 120)
    if out.returncode != 0:
        raise RuntimeError(f"load generator failed:\n{out.stderr[-2000:]}")
    result: dict[str, Any] = json.loads(out.stdout.strip().splitlines()[-1])
    return result


def cpu_seconds(pgid: int) -> float:
    """User + system CPU time of every live process in a process group (Linux /proc)."""
    ticks = os.sysconf("SC_CLK_TCK")
    total = 0
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            fields = stat_fields(f"/proc/{entry}/stat")
        except OSError:
            continue
        if int(fields[2]) == pgid:
            total += cpu_ticks(fields)
    return total / ticks


# ---- targets --------------------------------------------------------------------------------
class Stack:
    def __init__(self, logs: Path) -> None:
        self.logs = logs
        self.procs: list[Process] = []

    def start(
        self,
        name: str,
        argv: list[str],
        health: str,
        timeout: float = 60,
        env: dict[str, str] | None = None,
    ) -> Process:
        proc = Process(argv, log=self.logs / f"{name}.log", env=env)
        self.procs.append(proc)
        wait_http(health, timeout=timeout, proc=proc)
        return proc

    def stop(self, proc: Process) -> None:
        proc.stop()
        self.procs.remove(proc)

    def stop_all(self) -> None:
        for proc in reversed(self.procs):
            proc.stop()
        self.procs.clear()


def fake(stack: Stack, role: str, metaserver: str | None) -> tuple[str, Process]:
    port = free_port()
    argv = [sys.executable, "-m", "tests.fakes.vllm", "--role", role, "--port", str(port)]
    argv += ["--no-record"] + (["--metaserver", metaserver] if metaserver else [])
    proc = stack.start(f"fake-{role}-{port}", argv, f"http://127.0.0.1:{port}/health")
    return f"http://127.0.0.1:{port}", proc


def set_knobs(fakes: list[str], knobs: dict[str, Any]) -> None:
    import httpx

    for url in fakes if knobs else []:
        httpx.post(f"{url}/_fake/config", json=knobs, timeout=10).raise_for_status()


def ascend_fake(stack: Stack, role: str, kv_port: int) -> tuple[str, Process]:
    port = free_port()
    argv = [sys.executable, "-m", "tests.fakes.ascend", "--role", role, "--port", str(port)]
    argv += ["--kv-port", str(kv_port), "--no-record"]
    proc = stack.start(f"ascend-{role}-{port}", argv, f"http://127.0.0.1:{port}/health")
    return f"http://127.0.0.1:{port}", proc


def ascend_shim(root: Path) -> Path:
    """The one name the example imports from vllm_ascend (sfa_pd_rd2h/protocol.py)."""
    pkg = root / "vllm_ascend" / "distributed" / "kv_transfer" / "kv_p2p" / "sfa_pd_rd2h"
    pkg.mkdir(parents=True, exist_ok=True)
    for d in [pkg, *pkg.parents]:
        if d == root:
            break
        (d / "__init__.py").touch()
    (pkg / "protocol.py").write_text('BATCH_KV_TRANSFER_PARAMS = "batch_kv_transfer_params"\n')
    return root


def example_argv(path: Path, port: int, p: list[str], d: list[str]) -> list[str]:
    def hosts_ports(urls: list[str]) -> tuple[list[str], list[str]]:
        pairs = [u.removeprefix("http://").rsplit(":", 1) for u in urls]
        return [h for h, _ in pairs], [port for _, port in pairs]

    ph, pp = hosts_ports(p)
    dh, dp = hosts_ports(d)
    return [sys.executable, str(path), "--host", "127.0.0.1", "--port", str(port),
            "--prefiller-hosts", *ph, "--prefiller-ports", *pp,
            "--decoder-hosts", *dh, "--decoder-ports", *dp]  # fmt: skip


def pdgate_argv(
    port: int,
    p: list[str],
    d: list[str],
    flow: str,
    ms: str | None,
    workers: int,
    tree: Path | None = None,
    extra: tuple[str, ...] = (),
) -> list[str]:
    """``tree``: run the ``proxy`` package found there instead (a baseline copy of the code)."""
    if tree is None:
        argv = [sys.executable, "-m", "proxy.cli"]
    else:
        boot = f"import sys; sys.path[:0] = [{str(tree)!r}]; from proxy.cli import main; main()"
        argv = [sys.executable, "-c", boot]
    argv += ["--port", str(port), "--flow", flow]
    argv += [x for url in p for x in ("--prefill", url)] + [
        x for url in d for x in ("--decode", url)
    ]
    argv += ["--log-level", "warning", "--workers", str(workers)]
    argv += ["--prefill-policy", "round_robin", "--decode-policy", "round_robin", *extra]
    return argv + (["--metaserver", ms] if ms else [])


def router_argv(kind: str, port: int, p: list[str], d: list[str]) -> list[str] | None:
    exe = shutil.which(kind, path=str(BIN)) or shutil.which(kind)
    if exe is None:
        return None
    flag = "--pd-disaggregation" if kind == "sglang-router" else "--vllm-pd-disaggregation"
    argv = [exe] + (["launch"] if kind == "sglang-router" else [])
    argv += ["--host", "127.0.0.1", "--port", str(port), flag]
    argv += [x for url in p for x in ("--prefill", url)] + [
        x for url in d for x in ("--decode", url)
    ]
    argv += [
        "--policy",
        "round_robin",
        "--log-level",
        "warning" if kind == "vllm-router" else "warn",
    ]
    return argv


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--loadgen", help=argparse.SUPPRESS)
    ap.add_argument("--stream", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument(
        "--greedy",
        action="store_true",
        help="send temperature 0: the proxy compares P's and D's first tokens on each request",
    )
    ap.add_argument("--connections", type=int, default=64)
    ap.add_argument("--seconds", type=float, default=10.0)
    ap.add_argument("--warmup", type=float, default=2.0)
    ap.add_argument(
        "--rate",
        type=float,
        help="offer every target this many req/s (paced) instead of as many as the connections "
        "get through: CPU per request compared at the same load",
    )
    ap.add_argument("--workers", type=int, default=1, help="pdgate worker processes")
    ap.add_argument("--fakes", type=int, default=1, help="fake P and fake D instances (each)")
    ap.add_argument("--only", default="", help="comma-separated subset of targets")
    ap.add_argument("--json", type=Path, help="also write the results here")
    ap.add_argument(
        "--baseline",
        type=Path,
        help="a directory holding an older `proxy` package: adds pdgate@baseline targets",
    )
    ap.add_argument(
        "--aiohttp", action="store_true", help="also run pdgate with --http-client aiohttp"
    )
    ap.add_argument(
        "--tracing", action="store_true", help="also run pdgate with traces exported (OTLP)"
    )
    ap.add_argument(
        "--ascend-example",
        type=Path,
        help="a copy of vllm-ascend's load_balance_proxy_layerwise_server_example.py: adds "
        "ascend-example and pdgate-ascend-layerwise on fakes of vllm-ascend's engines",
    )
    ap.add_argument(
        "--ascend", action="store_true", help="add pdgate-ascend-layerwise (no example needed)"
    )
    ap.add_argument(
        "--per-call",
        action="store_true",
        help="also run decode-first with the fakes sending each metaserver write and each "
        "done signal as a request of its own (pdgate-decode-first@per-call; by default they "
        "batch writes and keep one signal channel per D, as the connector does)",
    )
    ap.add_argument(
        "--floor",
        action="store_true",
        help="add the lower bounds of floor_relay.py: floor-relay (prefill-first as bare "
        "callbacks), echo-lean and echo-asgi (a fixed answer without and with uvicorn's cycle)",
    )
    ap.add_argument(
        "--store",
        choices=["memory", "redis"],
        default="memory",
        help="the metaserver's store: its in-memory one, or a redis-server the bench starts "
        "(REDIS_SERVER or PATH names the binary)",
    )
    ap.add_argument(
        "--metaserver-workers",
        type=int,
        default=1,
        help="metaserver processes on its port (more than 1 needs --store redis)",
    )
    ap.add_argument(
        "--decode-first-target",
        default="2000,50",
        help="REQ_PER_S,P99_MS the decode-first rows are judged against",
    )
    args = ap.parse_args()
    if args.loadgen:
        try:
            import uvloop

            uvloop.install()
        except ImportError:
            pass
        asyncio.run(
            _loadgen(
                args.loadgen,
                args.connections,
                args.seconds,
                args.warmup,
                args.stream,
                args.rate,
                args.greedy,
            )
        )
        return

    os.chdir(REPO)
    logs = Path(tempfile.mkdtemp(prefix="proxy-bench-"))
    stack = Stack(logs)
    rows: list[dict[str, Any]] = []
    only = set(filter(None, args.only.split(",")))
    try:
        ms_port = free_port()
        ms = f"http://127.0.0.1:{ms_port}"
        ascend = bool(args.ascend or args.ascend_example)
        kv_ports = [free_port() for _ in range(args.fakes)] if ascend else []
        pool = ["--ascend-decode", ",".join(f"127.0.0.1:{k}" for k in kv_ports)] if ascend else []
        others: dict[str, list[Process]] = {}
        store: list[str] = []
        if args.store == "redis":
            redis_port = free_port()
            exe = os.environ.get("REDIS_SERVER") or shutil.which("redis-server")
            if exe is None:
                raise SystemExit("--store redis: no redis-server (install it or set REDIS_SERVER)")
            redis_argv = [exe, "--port", str(redis_port), "--save", "", "--appendonly", "no"]
            others["redis"] = [Process(redis_argv, log=logs / "redis.log")]
            stack.procs += others["redis"]
            wait_redis(redis_port)
            store = ["--store", f"redis://127.0.0.1:{redis_port}/0"]
        workers = ["--workers", str(args.metaserver_workers)]
        stack.start(
            "metaserver",
            [sys.executable, "-m", "metaserver.cli", "--port", str(ms_port), *pool, *store,
             *workers],
            ms + "/health",
        )  # fmt: skip
        ms_proc = stack.procs[-1]
        print(
            f"# metaserver: {args.store} store, {args.metaserver_workers} process(es); "
            f"{os.cpu_count()} cores",
            flush=True,
        )
        ps = [fake(stack, "prefill", ms) for _ in range(args.fakes)]
        ds = [fake(stack, "decode", ms) for _ in range(args.fakes)]
        p, d = [url for url, _ in ps], [url for url, _ in ds]
        others.update(metaserver=[ms_proc], P=[x for _, x in ps], D=[x for _, x in ds])
        aps = [ascend_fake(stack, "prefill", free_port()) for _ in kv_ports]
        ads = [ascend_fake(stack, "decode", k) for k in kv_ports]
        a_p, a_d = [url for url, _ in aps], [url for url, _ in ads]
        if ascend:
            others["P"] += [x for _, x in aps]
            others["D"] += [x for _, x in ads]
        w = args.workers
        targets: list[tuple[str, list[str] | None, str | None]] = [
            ("direct-D", None, d[0]),
            ("pdgate", pdgate_argv(0, p, d, "prefill-first", None, w), None),
            ("sglang-router", router_argv("sglang-router", 0, p, d), None),
            ("vllm-router", router_argv("vllm-router", 0, p, d), None),
            ("pdgate-decode-first", pdgate_argv(0, p, d, "decode-first", ms, w), None),
        ]

        def variant(name: str, flow: str, m: str | None, tree: Path | None, *extra: str) -> None:
            entry = (name, pdgate_argv(0, p, d, flow, m, w, tree, extra), None)
            if flow == "prefill-first":  # next to pdgate
                targets.insert(1, entry)
            else:
                targets.append(entry)

        envs: dict[str, dict[str, str]] = {}
        if args.ascend_example:
            shim = ascend_shim(logs / "shim")
            envs["ascend-example"] = {"PYTHONPATH": str(shim)}
            path = args.ascend_example.resolve()
            targets.append(("ascend-example", example_argv(path, 0, a_p, a_d), None))
        if ascend:
            targets.append(
                (
                    "pdgate-ascend-layerwise",
                    pdgate_argv(0, a_p, a_d, "ascend-layerwise", ms, w),
                    None,
                )
            )
        if args.aiohttp:
            variant("pdgate@aiohttp", "prefill-first", None, None, "--http-client", "aiohttp")
            variant("pdgate-decode-first@aiohttp", "decode-first", ms, None, "--http-client",
                    "aiohttp")  # fmt: skip
        if args.tracing:
            otlp_port = free_port()
            stack.start(
                "otlp-receiver",
                [sys.executable, "-m", "tests.support.otlp", "--port", str(otlp_port)],
                f"http://127.0.0.1:{otlp_port}/health",
            )
            otlp = ("--otlp-traces-endpoint", f"http://127.0.0.1:{otlp_port}/v1/traces")
            variant("pdgate@traced", "prefill-first", None, None, *otlp)
            variant("pdgate-decode-first@traced", "decode-first", ms, None, *otlp)
        knobs: dict[str, dict[str, Any]] = {}  # fake knobs for one target, reset after it
        if args.per_call:
            variant("pdgate-decode-first@per-call", "decode-first", ms, None)
            knobs["pdgate-decode-first@per-call"] = {"batch_writes": 1, "kv_signal": "post"}
        if args.floor:
            floor = [sys.executable, str(Path(__file__).with_name("floor_relay.py"))]
            targets += [
                ("floor-relay", [*floor, "relay", p[0], d[0], "--port", "0"], None),
                ("echo-lean", [*floor, "echo-lean", "--port", "0"], None),
                ("echo-asgi", [*floor, "echo-asgi", "--port", "0"], None),
            ]
        if args.baseline:
            variant("pdgate@baseline", "prefill-first", None, args.baseline.resolve())
            variant("pdgate-decode-first@baseline", "decode-first", ms, args.baseline.resolve())
        for name, argv, url in targets:
            if only and name not in only:
                continue
            proc = None
            if url is None:
                if argv is None:
                    print(f"# {name}: not installed, skipped", flush=True)
                    continue
                port = free_port()
                argv[argv.index("--port") + 1] = str(port)
                url = f"http://127.0.0.1:{port}"
                health = url + (
                    "/health"
                    if name.startswith("pdgate") or name in FLOOR
                    else "/healthcheck"
                    if name == "ascend-example"
                    else "/v1/models"
                )
                try:
                    proc = stack.start(name, argv, health, env=envs.get(name))
                except (RuntimeError, TimeoutError) as exc:
                    print(f"# {name}: did not start: {exc}", flush=True)
                    continue
            set_knobs(p + d, knobs.get(name, {}))
            for stream in (False, True):
                cpu0 = cpu_seconds(proc.pid) if proc else 0.0
                side0 = {k: sum(cpu_seconds(x.pid) for x in v) for k, v in others.items()}
                res = run_loadgen(url + "/v1/completions", args, stream)
                total = res["sent"]  # every request the CPU window saw
                cpu = (cpu_seconds(proc.pid) - cpu0) if proc else float("nan")
                res["cpu_us"] = cpu / total * 1e6 if total else float("nan")
                res["side_cpu_us"] = {
                    k: (sum(cpu_seconds(x.pid) for x in v) - side0[k]) / total * 1e6
                    if total
                    else float("nan")
                    for k, v in others.items()
                }
                row = {"target": name, "mode": "stream" if stream else "non-stream", **res}
                rows.append(row)
                print(
                    f"{name:<22} {row['mode']:<11} {res['rps']:>9.0f} req/s  "
                    f"p50 {res['p50']:>7.1f} ms  p99 {res['p99']:>7.1f} ms  "
                    f"router CPU {res['cpu_us']:>6.0f} us/req  errors {res['errors']}  (others: "
                    + ", ".join(f"{k} {v:.0f}" for k, v in res["side_cpu_us"].items())
                    + " us/req)",
                    flush=True,
                )
            if proc is not None:
                stack.stop(proc)
            if name in knobs:  # back to the fakes' defaults for the next target
                set_knobs(p + d, {k: getattr(Knobs(), k) for k in knobs[name]})
    finally:
        stack.stop_all()
    rps_goal, p99_goal = (float(x) for x in args.decode_first_target.split(","))
    report(rows, paced=bool(args.rate), decode_first=(rps_goal, p99_goal))
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2))
    print(f"# logs: {logs}")


def wait_redis(port: int, timeout_s: float = 20.0) -> None:
    import socket

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=1) as sock:
                sock.sendall(b"PING\r\n")
                if sock.recv(16).startswith(b"+PONG"):
                    return
        except OSError:
            time.sleep(0.05)
    raise RuntimeError(f"redis-server on port {port} did not answer PING in {timeout_s}s")


def report(
    rows: list[dict[str, Any]],
    paced: bool = False,
    decode_first: tuple[float, float] = (2000, 50),
) -> None:
    """The table, then each target's verdict; paced (``--rate``): only the CPU ones, as every
    target served the same req/s."""
    print(
        "\n| target | mode | req/s | p50 ms | p99 ms | router CPU µs/req | errors |"
        "\n|---|---|---:|---:|---:|---:|---:|"
    )
    for r in rows:
        print(
            f"| {r['target']} | {r['mode']} | {r['rps']:.0f} | {r['p50']:.1f} | {r['p99']:.1f} "
            f"| {r['cpu_us']:.0f} | {r['errors']} |"
        )
    for mode in ("non-stream", "stream"):
        for name in ("pdgate", "pdgate-decode-first"):
            new = next((r for r in rows if r["target"] == name and r["mode"] == mode), None)
            for other in ("baseline", "traced"):
                old = next(
                    (r for r in rows if r["target"] == f"{name}@{other}" and r["mode"] == mode),
                    None,
                )
                if new and old:
                    print(
                        f"{mode}: {name} vs {other}: {new['rps'] / old['rps']:.2f}x req/s, "
                        f"CPU {old['cpu_us']:.0f} ({other}) vs {new['cpu_us']:.0f} us/req, "
                        f"p99 {old['p99']:.1f} vs {new['p99']:.1f} ms"
                    )
        ours = next((r for r in rows if r["target"] == "pdgate" and r["mode"] == mode), None)
        rivals = [
            r for r in rows if r["target"] in ("sglang-router", "vllm-router") and r["mode"] == mode
        ]
        if ours and rivals and not paced:
            best = max(rivals, key=lambda r: r["rps"])
            ratio = ours["rps"] / best["rps"] if best["rps"] else float("inf")
            p99_ok = ours["p99"] <= min(r["p99"] for r in rivals)
            print(
                f"{mode}: pdgate / best ({best['target']}) = {ratio:.2f} "
                f"(target >= 1.0); p99 {ours['p99']:.1f} vs best-of-rivals "
                f"{min(r['p99'] for r in rivals):.1f} ms -> {'ok' if p99_ok else 'worse'}"
            )
        ours = next(
            (r for r in rows if r["target"] == "pdgate-ascend-layerwise" and r["mode"] == mode),
            None,
        )
        theirs = next(
            (r for r in rows if r["target"] == "ascend-example" and r["mode"] == mode), None
        )
        if ours and theirs:
            ratio = ours["rps"] / theirs["rps"] if theirs["rps"] else float("inf")
            p99 = ours["p99"] / theirs["p99"] if theirs["p99"] else float("nan")
            ok = ratio >= 10 and p99 <= 0.1 and ours["errors"] == 0
            print(
                f"{mode}: ascend-layerwise / vllm-ascend example = {ratio:.1f}x req/s, p99 "
                f"{ours['p99']:.1f} vs {theirs['p99']:.1f} ms ({p99:.3f}x), errors "
                f"{ours['errors']} vs {theirs['errors']} "
                f"(target >= 10x, p99 <= 0.1x, no errors) -> {'ok' if ok else 'below target'}"
            )
        cpu_targets(rows, mode)
        floors(rows, mode)
    for r in rows:
        if r["target"] == "pdgate-decode-first" and not paced:
            rps, p99 = decode_first
            verdict = "ok" if r["rps"] >= rps and r["p99"] <= p99 else "below target"
            print(
                f"decode-first {r['mode']}: {r['rps']:.0f} req/s, p99 {r['p99']:.1f} ms "
                f"(target >= {rps:.0f} req/s, p99 <= {p99:.0f} ms) -> {verdict}"
            )


def cpu_targets(rows: list[dict[str, Any]], mode: str) -> None:
    """Issue 16's CPU targets: decode-first's proxy CPU per request <= 1.2x prefill-first's,
    prefill-first's <= 2/3 of the best Rust router's (fairest with ``--rate``: the same load
    for every target, so no target's CPU figure is helped by bigger batches per loop turn)."""
    at = {r["target"]: r for r in rows if r["mode"] == mode}
    pf, df = at.get("pdgate"), at.get("pdgate-decode-first")
    if pf and df:
        ratio = df["cpu_us"] / pf["cpu_us"]
        print(
            f"{mode}: decode-first / prefill-first proxy CPU = {df['cpu_us']:.0f} / "
            f"{pf['cpu_us']:.0f} us/req = {ratio:.2f} (target <= 1.2), req/s "
            f"{df['rps']:.0f} / {pf['rps']:.0f} = {df['rps'] / pf['rps']:.2f}"
        )
    rivals = [at[n] for n in ("sglang-router", "vllm-router") if n in at]
    if pf and rivals:
        best = min(rivals, key=lambda r: r["cpu_us"])
        print(
            f"{mode}: prefill-first / best Rust router ({best['target']}) proxy CPU = "
            f"{pf['cpu_us']:.0f} / {best['cpu_us']:.0f} us/req = "
            f"{pf['cpu_us'] / best['cpu_us']:.2f} (target <= 0.67)"
        )


def floors(rows: list[dict[str, Any]], mode: str) -> None:
    """With ``--floor``: pdgate's CPU per request above the bare relay, and uvicorn's cycle
    above a bare protocol (best read with ``--rate``, every target at the same load)."""
    at = {r["target"]: r for r in rows if r["mode"] == mode}
    pf, relay = at.get("pdgate"), at.get("floor-relay")
    if pf and relay:
        print(
            f"{mode}: prefill-first proxy CPU = {pf['cpu_us']:.0f} us/req, the bare relay "
            f"{relay['cpu_us']:.0f}: {pf['cpu_us'] - relay['cpu_us']:.0f} above the floor"
        )
    lean, asgi = at.get("echo-lean"), at.get("echo-asgi")
    if lean and asgi:
        print(
            f"{mode}: a fixed answer: {asgi['cpu_us']:.0f} us/req through uvicorn's ASGI cycle, "
            f"{lean['cpu_us']:.0f} from a bare protocol: the cycle costs "
            f"{asgi['cpu_us'] - lean['cpu_us']:.0f}"
        )


if __name__ == "__main__":
    main()
