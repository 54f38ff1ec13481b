"""Connector push throughput vs raw Mooncake, and what the connector adds to vLLM's schedule().

    python tests/bench/push_bench.py [--layers 32] [--tokens 2048] [--repeat 5]

Part 1 starts a decode worker (the connector's receiver) in a second process and pushes a
realistic KV volume from this process over Mooncake TCP on loopback, twice per round:
  raw        batch_transfer_sync_write, one call per layer, the same (coalesced) pieces;
  connector  the real sender path: save_kv_layer per layer -> event -> coalesce -> batched
             write -> done signal, timed until the transfer is settled (signal sent).
Part 2 times vLLM's real Scheduler.schedule() admitting 8 remote-prefill requests per call:
without a connector, with a bare one (vLLM's own cost of an asynchronous load), and with
pdgate's, its metaserver answering after 2 s or at once; back to back, and with a pause
between calls standing for the forward pass (the engine thread waits, the GIL is free).
Both parts print a table; each comparison is made within this run.
"""

from __future__ import annotations

import argparse
import logging
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

import httpx  # noqa: E402
import torch  # noqa: E402

from connector import wire  # noqa: E402
from connector.layout import Piece, pair_pieces  # noqa: E402
from connector.metadata import Destination, PdgateMetadata, SendChunk  # noqa: E402
from connector.worker import ConnectorWorker  # noqa: E402
from connector.worker.side_channel import handshake  # noqa: E402
from tests.connector.mooncake_peer import allocate, worker  # noqa: E402
from tests.support.procs import Process, free_port  # noqa: E402
from tests.support.sealing import key_file  # noqa: E402

D_SCRIPT = """
import sys, time
sys.path.insert(0, {repo!r})
from tests.connector.mooncake_peer import allocate, worker
w = worker("kv_consumer", {port}, "d-engine", 600)
w.register_kv_caches(allocate({blocks}, {heads}, 16, {head}, {layers}))
print("READY", flush=True)
while True:
    w.transfer_results(set()); time.sleep(0.05)
"""


def _wait_ready(proc: Process, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while "READY" not in proc.tail(50):
        if not proc.alive() or time.monotonic() > deadline:
            raise RuntimeError(f"decode peer failed:\n{proc.tail()}")
        time.sleep(0.1)


def push_bench(a: argparse.Namespace) -> list[tuple[str, float, float, float, float]]:
    layers = [f"model.layers.{i}.self_attn.attn" for i in range(a.layers)]
    blocks = a.tokens // 16
    port = free_port()
    log = Path("/tmp") / f"push_bench_d_{port}.log"
    script = D_SCRIPT.format(
        repo=str(REPO),
        port=port,
        blocks=blocks + 8 + blocks // a.run,
        heads=a.heads,
        head=a.head,
        layers=layers,
    )
    key_file()  # D's process reads the same side-channel key (its path is in the environment)
    d = Process([sys.executable, "-c", script], log=log)
    try:
        _wait_ready(d)
        p: ConnectorWorker = worker("kv_producer", 1, "p-engine", 600)
        p.total_kv_heads = a.heads
        caches = allocate(blocks + 8, a.heads, 16, a.head, layers)
        for t in caches.values():
            t.normal_()
        p.register_kv_caches(caches)
        assert p.memory is not None and p.sender is not None
        hs = handshake("127.0.0.1", port, wire.Hello("bench"), 10.0, channel=p.channel)
        dest = Destination("dec", "d-engine", "127.0.0.1", port, 1, a.heads, False, 16)
        results: list[tuple[str, float, float, float, float]] = []
        for label, pairs in _patterns(blocks, a.run):
            pieces = pair_pieces(p.memory.layout(0), hs.layout(0), pairs, (0, a.heads), 0)
            nbytes = sum(piece.length for piece in pieces) * len(layers)
            raw_t: list[float] = []
            batch_t: list[float] = []
            conn_t: list[float] = []
            for rnd in range(a.repeat):
                raw_t.append(_raw(p, hs, pieces, layers, per_layer=True))
                batch_t.append(_raw(p, hs, pieces, layers, per_layer=False))
                conn_t.append(_connector(p, dest, pairs, layers, f"{label}-{rnd}"))
            raw = statistics.median(raw_t)
            batch = statistics.median(batch_t)
            conn = statistics.median(conn_t)
            best = min(raw, batch)
            results.append(
                (label, nbytes / raw / 1e9, nbytes / batch / 1e9, nbytes / conn / 1e9, best / conn)
            )
            print(f"  {label}: {len(pieces)} pieces/layer, {nbytes / 2**20:.0f} MiB", flush=True)
        p.shutdown()
        return results
    finally:
        d.stop()


def _patterns(blocks: int, run: int) -> list[tuple[str, list[tuple[int, int]]]]:
    contiguous = [(i, i + 4) for i in range(blocks)]
    # D's free blocks come in runs of `run`, separated by one used block
    fragmented = [(i, 4 + i + i // run) for i in range(blocks)]
    return [("contiguous", contiguous), (f"runs-of-{run}", fragmented)]


def _raw(
    p: ConnectorWorker,
    hs: wire.Welcome,
    pieces: list[Piece],
    layers: list[str],
    *,
    per_layer: bool,
) -> float:
    """The same pieces through ``batch_transfer_sync_write``: a call per layer, or one call."""
    assert p.memory is not None
    calls: list[tuple[list[int], list[int], list[int]]] = []
    for li, name in enumerate(layers):
        di = hs.layer_names.index(name)
        src = [p.memory.bases[li][pc.plane] + pc.src for pc in pieces]
        dst = [hs.layer_bases[di][pc.plane] + pc.dst for pc in pieces]
        calls.append((src, dst, [pc.length for pc in pieces]))
    if not per_layer:
        calls = [
            (
                [x for c in calls for x in c[0]],
                [x for c in calls for x in c[1]],
                [x for c in calls for x in c[2]],
            )
        ]
    t0 = time.perf_counter()
    for src, dst, lengths in calls:
        p.transport.write(hs.session, src, dst, lengths)
    return time.perf_counter() - t0


def _connector(
    p: ConnectorWorker, dest: Destination, pairs: list[tuple[int, int]], layers: list[str], tid: str
) -> float:
    assert p.sender is not None
    meta = PdgateMetadata(sends=[SendChunk(tid, tid, dest, pairs, True)])
    t0 = time.perf_counter()
    p.start_step(meta)
    for name in layers:
        p.save_layer(meta, name)
    p.end_step(meta)
    while not p.sender.settled(tid):
        time.sleep(0.0005)
    elapsed = time.perf_counter() - t0
    for tr in p.sender.transfers[tid]:
        assert not tr.error, tr.error
    p.transfer_results({tid})
    return elapsed


_HOOKS = (
    "get_num_new_matched_tokens",
    "update_state_after_alloc",
    "build_connector_meta",
    "update_connector_output",
    "request_finished",
)


def _time_hooks(connector: Any) -> list[float]:
    """Wrap the connector's scheduler-side hooks: the returned cell accumulates their seconds
    (what the connector itself adds to vLLM's loop, apart from vLLM's own async-load work)."""
    spent = [0.0]
    for name in _HOOKS:
        inner = getattr(connector, name)

        def timed(*args: Any, _inner: Any = inner, **kw: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return _inner(*args, **kw)
            finally:
                spent[0] += time.perf_counter() - t0

        setattr(connector, name, timed)
    return spent


@dataclass(frozen=True, slots=True)
class SchedRow:
    label: str
    gap_ms: float  # the model's step between two schedule() calls (GIL released)
    median_ms: float  # schedule(), 8 requests admitted per call
    max_ms: float
    hooks_us: float  # inside pdgate's connector hooks, per admitted request
    cpu_us: float  # this process's CPU per request (all threads), writes finished


def _sched_case(a: argparse.Namespace, model: Path, case: str, url: str, gap_ms: float) -> SchedRow:
    from tests.connector import harness as H

    cfg = H.vllm_config(
        model,
        "kv_consumer",
        {
            "metaserver_url": url,
            "metaserver_token": "t",
            "instance_id": "bench-d",
            "side_channel_host": "127.0.0.1",
            "heartbeat_s": 60,
        },
    )
    assert cfg.kv_transfer_config is not None
    if case == "none":
        cfg.kv_transfer_config = None
    elif case == "bare":
        cfg.kv_transfer_config.kv_connector = "BareConnector"
        cfg.kv_transfer_config.kv_connector_module_path = "tests.bench.bare_connector"
    s = H.scheduler(cfg, num_blocks=4000)
    pdgate = s.connector if case in ("slow", "fast") else None
    spent = _time_hooks(pdgate) if pdgate is not None else [0.0]
    times: list[float] = []
    arrived: set[str] = set()  # KV "arrives" one step after the binding went out
    cpu0 = time.process_time()
    for i in range(a.sched_requests):
        params = None
        if case != "none":
            params = {"do_remote_prefill": True, "transfer_id": f"{case}{i}", "metaserver": "x"}
        s.add_request(H.request(H.prompt(200, seed=i), params, max_tokens=1))
        if i % 8 == 7:
            t0 = time.perf_counter()
            so = s.schedule()
            times.append(time.perf_counter() - t0)
            if gap_ms:
                time.sleep(gap_ms / 1e3)  # the forward pass: the engine thread waits, GIL free
            s.update_from_output(so, H.runner_output(so, recving=arrived))
            arrived = {r.req_id for r in getattr(so.kv_connector_metadata, "recvs", [])}
    if case == "fast":  # the bindings' HTTP work runs on the writer's threads, in this process
        writer = pdgate.scheduler.writer  # type: ignore[union-attr]
        while writer.pending():
            time.sleep(0.001)
    cpu = (time.process_time() - cpu0) / a.sched_requests * 1e6
    if s.connector is not None and case != "bare":
        s.connector.shutdown()
    n = a.sched_requests
    med, mx = statistics.median(times) * 1e3, max(times) * 1e3
    return SchedRow(CASES[case], gap_ms, med, mx, spent[0] / n * 1e6, cpu)


CASES = {
    "none": "no connector (local prefill)",
    "bare": "async load, bare connector",
    "slow": "pdgate, metaserver 2 s late",
    "fast": "pdgate, metaserver answering",
}


def sched_bench(a: argparse.Namespace) -> list[SchedRow]:
    """vLLM's real Scheduler admits 8 new remote-prefill requests per ``schedule()``.

    ``bare`` is vLLM's own floor for such a request (tests/bench/bare_connector.py): what pdgate
    adds to the engine loop is measured against it. ``slow``: the metaserver answers after
    2 s (``schedule()`` must not notice). ``fast``: it answers at once, so the writer's
    threads do their HTTP work in this process meanwhile, as in a running engine."""
    from launch.tiny_model import make_tiny_model
    from tests.connector.slow_proxy import SlowProxy
    from tests.support.services import MetaserverProcess

    model = make_tiny_model(Path("/tmp") / "pdgate-bench-models")
    ms = MetaserverProcess(
        "memory", "--token", "t", "--max-instance-ttl", "600", log_dir=Path("/tmp")
    )
    slow = SlowProxy(ms.url, 2.0)
    rows: dict[tuple[float, str], list[SchedRow]] = {}
    try:
        # register up front (heartbeats through the slow proxy are slow too)
        httpx.put(
            f"{ms.url}/v1/instances/bench-d",
            json={
                "role": "decode",
                "url": "http://127.0.0.1:8000",
                "ttl_s": 600,
                "kv_endpoint": {"host": "127.0.0.1", "port": 5600},
            },
            headers={"authorization": "Bearer t"},
        ).raise_for_status()
        for r in range(a.sched_rounds):  # cases interleaved: drift of a shared machine spreads
            for gap in a.sched_gaps:
                for case in CASES:
                    url = slow.url if case == "slow" else ms.url
                    got = _sched_case(a, model, case, url, gap)
                    rows.setdefault((gap, case), []).append(got)
                    print(
                        f"  round {r + 1}/{a.sched_rounds}: {case}, {gap} ms steps",
                        file=sys.stderr,
                        flush=True,
                    )
    finally:
        slow.close()
        ms.stop()
    return [
        SchedRow(
            CASES[case],
            gap,
            statistics.median(x.median_ms for x in got),
            max(x.max_ms for x in got),
            statistics.median(x.hooks_us for x in got),
            statistics.median(x.cpu_us for x in got),
        )
        for (gap, case), got in rows.items()
    ]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--heads", type=int, default=8, help="KV heads (float32, CPU layout)")
    ap.add_argument("--head", type=int, default=64, help="head size")
    ap.add_argument("--run", type=int, default=8, help="block run length, fragmented case")
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--sched-requests", type=int, default=256)
    ap.add_argument("--sched-rounds", type=int, default=3)
    ap.add_argument(
        "--sched-gaps",
        type=lambda v: [float(x) for x in v.split(",")],
        default=[0.0, 5.0],
        help="ms between schedule() calls, the forward pass (GIL released): comma-separated",
    )
    ap.add_argument("--skip-sched", action="store_true")
    ap.add_argument("--skip-push", action="store_true")
    a = ap.parse_args()
    torch.set_num_threads(1)
    logging.getLogger("pdgate").setLevel(logging.ERROR)  # teardown noise of part 2
    rows = [] if a.skip_push else push_bench(a)
    print(f"push: {a.layers} layers x {a.tokens} tokens, {a.heads} KV heads x {a.head}, fp32")
    print(
        f"\n{'pattern':<14}{'raw/layer GB/s':>16}{'raw/1 call GB/s':>17}"
        f"{'connector GB/s':>16}{'vs best raw':>13}  (target >= 0.90)"
    )
    for label, raw, batch, conn, ratio in rows:
        print(f"{label:<14}{raw:>16.2f}{batch:>17.2f}{conn:>16.2f}{ratio:>13.2f}")
    if not a.skip_sched:
        srows = sched_bench(a)
        for gap in a.sched_gaps:
            print(
                f"\n{f'{gap:g} ms model step, 8 admitted':<32}{'median ms':>10}{'max ms':>9}"
                f"{'+us/req vs bare':>17}{'hooks us/req':>14}{'CPU us/req':>12}"
            )
            these = [r for r in srows if r.gap_ms == gap]
            bare = next(r for r in these if r.label == CASES["bare"])
            for row in these:
                added = (row.median_ms - bare.median_ms) / 8 * 1e3
                show = f"{added:>17.1f}" if row.hooks_us else f"{'-':>17}"
                print(
                    f"{row.label:<32}{row.median_ms:>10.3f}{row.max_ms:>9.3f}{show}"
                    f"{row.hooks_us:>14.1f}{row.cpu_us:>12.1f}"
                )
        print("target: pdgate adds <= 30 us per admitted request to schedule() (vs bare)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
