"""The connector's device path on an NVIDIA GPU: layer-by-layer pushes between CUDA KV caches.

For each case, P's and D's KV caches are CUDA tensors built the way vLLM builds its per-layer
``[B, H, N, C]`` views for a ``KVCacheLayout`` (``tests/support/kv_views.py``, checked against
vLLM's own allocator on CPU by ``tests/connector/test_kv_views.py``; vLLM is not installed
here), or vllm-ascend's separate K/V tensors. They are registered with the connector's real
worker halves (``device: cuda``), which talk over their ZeroMQ side channel; the in-process
transport copies with ``cudaMemcpyAsync`` on a stream of its own and waits for that stream
(what a Mooncake write waits for: its own transfer).

The "forward" runs on a CUDA stream: per chunk and layer, a synthetic compute (matrix
products sized to ``--layer-ms``), then the layer's KV of the chunk written into P's cache,
then ``save_kv_layer`` (a CUDA event on that stream). The table reports, per case, the bytes
pushed, the pieces per layer and chunk, the push time, how much of it ran while the GPU was
still computing (compute end measured with CUDA timing events), how the sender thread waited
(event waits vs stream/device synchronizes, counted by wrapping torch's calls), and whether
D's blocks equal P's exactly.

    python3 tests/gpu/push_layers.py [--layers 32] [--tokens 4090] [--json FILE]
    python3 tests/gpu/push_layers.py --device cpu --layers 4 --tokens 500 --hidden 64  (a dry run)
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import sys
import tempfile
import threading
import time
import types
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))


def _stub_vllm() -> bool:
    """Without vLLM, give the connector the vLLM names its worker half imports, as vLLM 0.32
    has them (``vllm/distributed/kv_transfer/kv_connector/v1/base.py``): the marker classes
    ``KVConnectorMetadata`` and ``KVConnectorWorkerMetadata`` (empty), ``KVConnectorBase_V1``
    with ``bind_kv_cache_manager``, ``KVConnectorTransferResults``, and the module
    ``vllm.v1.kv_cache_layout`` (what ``connector.compat.features`` looks for).
    ``PDGATE_STUB_VLLM=1`` stubs even where vLLM is installed (to try the stub on CPU)."""
    if not os.environ.get("PDGATE_STUB_VLLM"):
        try:
            import vllm  # noqa: F401

            return False
        except ImportError:
            pass
    import importlib.machinery

    base_path = "vllm.distributed.kv_transfer.kv_connector.v1.base"
    for path in (base_path, "vllm.v1.kv_cache_layout"):
        parts = path.split(".")
        for i in range(1, len(parts) + 1):
            name = ".".join(parts[:i])
            module = types.ModuleType(name)
            module.__spec__ = importlib.machinery.ModuleSpec(name, None, is_package=i < len(parts))
            module.__path__ = []
            sys.modules.setdefault(name, module)

    class KVConnectorMetadata:  # vLLM's markers: empty classes
        pass

    class KVConnectorWorkerMetadata:
        pass

    class KVConnectorBase_V1:
        def bind_kv_cache_manager(self, manager: Any) -> None:
            pass

    @dataclass
    class KVConnectorTransferResults:
        finished_sending: set[str] = field(default_factory=set)
        finished_recving: set[str] = field(default_factory=set)
        failed_recving: set[str] = field(default_factory=set)

    base = sys.modules[base_path]
    for cls in (
        KVConnectorMetadata,
        KVConnectorWorkerMetadata,
        KVConnectorBase_V1,
        KVConnectorTransferResults,
    ):
        setattr(base, cls.__name__, cls)
    return True


STUBBED = _stub_vllm()

import torch  # noqa: E402

from connector import tp  # noqa: E402
from connector.layout import pair_pieces  # noqa: E402
from connector.metadata import PdgateMetadata, SendChunk  # noqa: E402
from connector.transport import InProcessTransport, Transport  # noqa: E402
from tests.connector import cluster as C  # noqa: E402
from tests.support import kv_views  # noqa: E402

BS = 16


@dataclass(frozen=True)
class Case:
    p: str  # a KVCacheLayout member, or "ascend" (separate K and V tensors)
    d: str
    p_tp: int = 1
    mla: bool = False
    verify: bool = False  # verify_kv: digests of device memory, checked on D
    tamper: bool = False  # test_corrupt_push: D must detect a wrong block and fail the load
    d_tp: int = 1
    heads: int = 0  # KV heads (global); 0: ``--heads``
    sealed: bool = False  # side channel sealed with a secret (connector/seal.py)

    @property
    def name(self) -> str:
        kind = "mla " if self.mla else ""
        kind += f"{self.heads}kv " if self.heads else ""
        extra = " +verify_kv" if self.verify else ""
        extra += " +corrupt" if self.tamper else ""
        extra += " +sealed" if self.sealed else ""
        return f"{kind}{self.p}->{self.d} tp{self.p_tp}:{self.d_tp}{extra}"


CASES = [
    Case("LBNHC", "LBNHC"),  # FlashAttention / Triton's choice on Hopper
    Case("LBHNC", "LBHNC"),  # FlashInfer on Blackwell, vLLM's CPU backend
    Case("BLNHC", "BLNHC"),  # layers interleaved per block
    Case("LHBNC", "LHBNC"),  # heads outer to blocks
    Case("BLNHC", "LBHNC"),  # P and D in different layouts: one write per token-head
    Case("LBNHC", "LBNHC", p_tp=2),  # token-major pages: a head slice is a run per token
    Case("LBNHC", "LBHNC", p_tp=2),
    Case("LBHNC", "LBHNC", p_tp=2),  # what the connector asks vLLM for (kv_cache_layout)
    Case("LBHNC", "LBHNC", p_tp=4),
    Case("LBNHC", "LBNHC", mla=True),
    Case("ascend", "ascend"),
    Case("LBHNC", "LBHNC", verify=True),
    Case("LBHNC", "LBHNC", verify=True, tamper=True),
    # D tp > P tp: P's heads split over D's ranks (GQA), replicated into them (fewer KV heads
    # than D ranks), and MLA's latent into every D rank; same-TP baselines beside them
    Case("LBHNC", "LBHNC", d_tp=2),
    Case("LBNHC", "LBNHC", d_tp=2),
    Case("LBHNC", "LBHNC", p_tp=2, d_tp=4),
    Case("LBHNC", "LBHNC", heads=2),
    Case("LBHNC", "LBHNC", heads=2, d_tp=4),
    Case("LBNHC", "LBNHC", mla=True, d_tp=2),
    Case("LBNHC", "LBNHC", mla=True, p_tp=2, d_tp=4),
    # the side channel sealed (HMAC of every handshake, keep-alive and signal): each beside
    # its unsealed case above; +verify_kv sends the largest signals (a digest per piece)
    Case("LBHNC", "LBHNC", sealed=True),
    Case("LBHNC", "LBHNC", p_tp=2, sealed=True),
    Case("LBHNC", "LBHNC", d_tp=2, sealed=True),
    Case("LBHNC", "LBHNC", verify=True, sealed=True),
]
SEALED_PAIRS = "2,21,8,22,14,23,12,24"  # (--only) each sealed case after its unsealed one


class CudaCopy:
    """The in-process transport's copy for device memory: one ``cudaMemcpyAsync`` per piece
    on a non-blocking stream of its own, then a wait for that stream only."""

    def __init__(self) -> None:
        import cupy

        self._memcpy = cupy.cuda.runtime.memcpyAsync
        self._stream = cupy.cuda.Stream(non_blocking=True)
        self.waits = 0
        self.pieces = 0

    def __call__(self, src: list[int], dst: list[int], lengths: list[int]) -> None:
        stream, memcpy = self._stream.ptr, self._memcpy
        for s, d, n in zip(src, dst, lengths, strict=True):
            memcpy(d, s, n, 4, stream)  # cudaMemcpyDefault: unified addressing
        self._stream.synchronize()
        self.waits += 1
        self.pieces += len(src)


class SyncWatch:
    """Counts, per thread, host waits through torch: event, stream and device synchronizes."""

    def __init__(self) -> None:
        self.counts: collections.Counter[tuple[str, str]] = collections.Counter()

    def install(self) -> None:
        cuda = torch.cuda
        for owner, attr, kind in (
            (cuda.Event, "synchronize", "event"),
            (cuda.Stream, "synchronize", "stream"),
            (cuda, "synchronize", "device"),
        ):
            original = getattr(owner, attr)

            def wrapped(*a: Any, _o: Any = original, _k: str = kind, **kw: Any) -> Any:
                self.counts[(threading.current_thread().name, _k)] += 1
                return _o(*a, **kw)

            setattr(owner, attr, wrapped)

    def of(self, thread: str) -> dict[str, int]:
        return {k: self.counts[(thread, k)] for k in ("event", "stream", "device")}

    def reset(self) -> None:
        self.counts.clear()


@dataclass
class Result:
    case: str
    mb: float
    pieces: int  # per layer and chunk, on P rank 0's first leg (the largest chunk)
    writes: int
    push_ms: float
    compute_ms: float
    exposed_ms: float
    hidden: float  # share of the push that ran while the GPU computed
    connector_hidden: float  # the same share as the connector's done event reports it
    d_done_after_ms: float  # D saw the load complete this long after the GPU's compute ended
    sender_waits: dict[str, int] = field(default_factory=dict)
    copy_waits: int = 0
    exact: bool = False  # D's blocks equal P's (a corrupt case: D detected it and failed)


def chunks_of(tokens: int, bounds: list[int]) -> list[list[int]]:
    """P blocks completed by each chunk (full blocks; the tail block with the last)."""
    out, done = [], 0
    for i, end in enumerate(bounds):
        last = i == len(bounds) - 1
        upto = -(-end // BS) if last else end // BS
        out.append(list(range(done, upto)))
        done = upto
    return out


def _alloc(kind: str, layers: list[str], a: argparse.Namespace, mla: bool, device: str) -> Any:
    def alloc(local_heads: int) -> dict[str, Any]:
        if kind == "ascend":
            return dict(
                kv_views.ascend_views(
                    layers,
                    blocks=a.blocks,
                    heads=local_heads,
                    head_size=a.head,
                    block_size=BS,
                    dtype=torch.bfloat16,
                    device=device,
                )
            )
        return kv_views.vllm_views(
            kind,
            layers,
            blocks=a.blocks,
            heads=local_heads,
            head_size=4 * a.head if mla else a.head,
            block_size=BS,
            dtype=torch.bfloat16,
            mla=mla,
            device=device,
        )

    return alloc


def _parts(value: Any) -> list[torch.Tensor]:
    split = isinstance(value, tuple)
    return [kv_views.logical(t, split) for t in (value if split else (value,))]


def run_case(case: Case, a: argparse.Namespace, watch: SyncWatch | None) -> Result:
    dev = a.device
    layers = [f"model.layers.{i}.self_attn.attn" for i in range(a.layers)]
    kv_heads = case.heads or a.heads
    heads = 1 if case.mla else kv_heads
    copy = CudaCopy() if dev == "cuda" else None
    transports: list[Transport] = [
        InProcessTransport(copy) if copy else InProcessTransport()
        for _ in range(case.p_tp + case.d_tp)
    ]
    port = C.free_port_range(case.d_tp)
    env = {
        "PDGATE_CONNECTOR_VERIFY_KV": "1" if case.verify else "0",
        # a corrupt block never "lands": D need not wait long for it (default 10 s)
        "PDGATE_CONNECTOR_LANDING_WAIT_S": "0.5" if case.tamper else "10",
        "PDGATE_CONNECTOR_SIDE_CHANNEL_SECRET_FILE": a.secret_file if case.sealed else "",
    }
    os.environ.update(env)
    d = C.make_instance(
        "d-eng",
        "kv_consumer",
        case.d_tp,
        heads=kv_heads,
        mla=case.mla,
        port=port,
        blocks=a.blocks,
        block_size=BS,
        layers=layers,
        device=dev,
        transports=transports[: case.d_tp],
        timeout_s=120,
        allocate=_alloc(case.d, layers, a, case.mla, dev),
    )
    if case.tamper:
        os.environ.update(PDGATE_ALLOW_TEST_HOOKS="1", PDGATE_CONNECTOR_TEST_CORRUPT_PUSH="1")
    p = C.make_instance(
        "p-eng",
        "kv_producer",
        case.p_tp,
        heads=kv_heads,
        mla=case.mla,
        blocks=a.blocks,
        block_size=BS,
        layers=layers,
        device=dev,
        transports=transports[case.d_tp :],
        allocate=_alloc(case.p, layers, a, case.mla, dev),
    )
    try:
        g = torch.Generator(device=dev).manual_seed(7)
        ref = {  # the global KV each layer's attention "writes", per plane, as [B, H, N, C]
            name: [
                torch.randn((a.blocks, heads, BS, t.shape[3]), generator=g, device=dev).to(t.dtype)
                for t in _parts(d.caches[0][name])
            ]
            for name in layers
        }
        blocks = chunks_of(a.tokens, a.bounds)
        offset = 3  # D's blocks: P's shifted, as a fresh D allocation gives them
        pairs = [[(b, b + offset) for b in chunk] for chunk in blocks]
        C.expect(d, "dreq", "tgpu", [db for chunk in pairs for _, db in chunk])
        dest = C.destination(d, port)
        hidden = a.hidden
        x = torch.randn((max(len(c) for c in blocks) * BS, hidden), device=dev).to(torch.bfloat16)
        w = (torch.randn((hidden, hidden), device=dev) / hidden**0.5).to(torch.bfloat16)
        compute = torch.cuda.Stream() if dev == "cuda" else None
        indices = [torch.tensor([pb for pb, _ in cp], device=dev) for cp in pairs]
        repeat = a.repeat
        if dev == "cuda":
            torch.cuda.synchronize()
        if watch:
            watch.reset()
        t_start = time.perf_counter()
        begin = end = None
        ctx = torch.cuda.stream(compute) if compute is not None else _Null()
        with ctx:
            if dev == "cuda":
                begin = torch.cuda.Event(enable_timing=True)
                begin.record()
                t_start = time.perf_counter()
            for ci, chunk_pairs in enumerate(pairs):
                last = ci == len(pairs) - 1
                meta = PdgateMetadata(sends=[SendChunk("preq", "tgpu", dest, chunk_pairs, last)])
                idx = indices[ci]
                h = x[: len(chunk_pairs) * BS]
                for wk in p.workers:
                    wk.start_step(meta)
                for name in layers:
                    for _ in range(repeat):  # the layer's compute
                        h = torch.tanh(h @ w)
                    for rank, caches in enumerate(p.caches):  # attention writes its KV
                        start, n = (0, 1) if case.mla else p.local(rank)
                        for part, want in zip(_parts(caches[name]), ref[name], strict=True):
                            part[idx] = want[idx, start : start + n]
                    for wk in p.workers:
                        wk.save_layer(meta, name)
                for wk in p.workers:
                    wk.end_step(meta)
            if dev == "cuda":
                end = torch.cuda.Event(enable_timing=True)
                end.record()
        recv = [set[str]() for _ in d.workers]  # per D rank
        failed: set[str] = set()
        deadline = time.monotonic() + 120
        while not all("dreq" in r for r in recv) and not failed and time.monotonic() < deadline:
            for rank, dw in enumerate(d.workers):
                _, r, f = dw.transfer_results(set())
                recv[rank] |= r
                failed |= f
            time.sleep(0.0002)
        t_d_done = time.perf_counter()
        if begin is not None and end is not None:
            end.synchronize()
            compute_end = t_start + begin.elapsed_time(end) / 1e3
        else:
            compute_end = time.perf_counter() if dev != "cuda" else t_d_done
        compute_ms = (compute_end - t_start) * 1e3
        spans: list[tuple[float, float]] = []
        nbytes, connector_hidden, writes = 0, 1.0, 0
        for wk in p.workers:
            assert wk.sender is not None
            deadline = time.monotonic() + 60
            while not wk.sender.settled("preq") and time.monotonic() < deadline:
                time.sleep(0.001)
            for tr in wk.sender.transfers.get("preq", []):  # one leg per D rank written
                spans += tr.write_spans
                nbytes += tr.bytes
                connector_hidden = min(connector_hidden, tr.overlap().hidden)
            writes += wk.sender.writes
        push = sum(e - s for s, e in spans)
        exposed = sum(max(0.0, e - max(s, compute_end)) for s, e in spans)
        waits = watch.of("pdgate-sender") if watch else {}
        C.poll(p, {"preq"}, lambda acc: all("preq" in s for s, _, _ in acc), 60)
        exact = all("dreq" in r for r in recv) and not failed
        if case.tamper:  # D must have caught the corrupt block and failed its load
            return _result_of_tamper(case, failed, compute_ms)
        flat = [pr for chunk in pairs for pr in chunk]
        pb = torch.tensor([x for x, _ in flat], device=dev)
        db = torch.tensor([y for _, y in flat], device=dev)
        untouched = torch.ones(a.blocks, dtype=torch.bool, device=dev)
        untouched[db] = False
        for rank, caches in enumerate(d.caches):  # each D rank holds its heads of the global KV
            start, n = (0, 1) if case.mla else d.local(rank)
            for name in layers:
                for part, want in zip(_parts(caches[name]), ref[name], strict=True):
                    exact = exact and torch.equal(part[db], want[pb, start : start + n])
                    exact = exact and not part[untouched].any()
        p_lay, d_lay = p.workers[0].memory.layout(0), d.workers[0].memory.layout(0)  # type: ignore[union-attr]
        leg = tp.routes(0, case.p_tp, case.d_tp, kv_heads, case.mla)[0]
        biggest = max(pairs, key=len)
        pieces = len(
            pair_pieces(p_lay, d_lay, biggest, (leg.p_head_start, leg.num_heads), leg.d_head_start)
        )
        return Result(
            case.name,
            nbytes / 2**20,
            pieces,
            writes,
            push * 1e3,
            compute_ms,
            exposed * 1e3,
            1.0 - exposed / push if push else 1.0,
            connector_hidden,
            (t_d_done - compute_end) * 1e3,
            waits,
            copy.waits if copy else 0,
            bool(exact),
        )
    finally:
        for key in ("PDGATE_ALLOW_TEST_HOOKS", "PDGATE_CONNECTOR_TEST_CORRUPT_PUSH"):
            os.environ.pop(key, None)
        C.close(p, d)


def _result_of_tamper(case: Case, failed: set[str], compute_ms: float) -> Result:
    return Result(case.name, 0.0, 0, 0, 0.0, compute_ms, 0.0, 0.0, 0.0, 0.0, exact="dreq" in failed)


class _Null:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


def calibrate(a: argparse.Namespace) -> int:
    """Matrix products per layer so that one layer of the largest chunk takes ``--layer-ms``."""
    if a.device != "cuda":
        return 1
    tokens = max(len(c) for c in chunks_of(a.tokens, a.bounds)) * BS
    x = torch.randn((tokens, a.hidden), device="cuda").to(torch.bfloat16)
    w = (torch.randn((a.hidden, a.hidden), device="cuda") / a.hidden**0.5).to(torch.bfloat16)
    for _ in range(3):
        x = torch.tanh(x @ w)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(20):
        x = torch.tanh(x @ w)
    torch.cuda.synchronize()
    one = (time.perf_counter() - t0) / 20 * 1e3
    return max(1, round(a.layer_ms / one))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--tokens", type=int, default=4090)
    ap.add_argument("--heads", type=int, default=8, help="KV heads (global)")
    ap.add_argument("--head", type=int, default=128, help="head size")
    ap.add_argument("--layer-ms", type=float, default=1.0, help="compute per layer and chunk")
    ap.add_argument("--hidden", type=int, default=4096, help="width of the synthetic compute")
    ap.add_argument(
        "--only",
        default="",
        help="comma-separated case numbers (1-based, run in that order), or 'sealed': each "
        "sealed case after its unsealed one",
    )
    ap.add_argument("--rounds", type=int, default=1, help="run the chosen cases this many times")
    ap.add_argument("--json", type=Path)
    a = ap.parse_args()
    a.bounds = [round(a.tokens * f) for f in (0.245, 0.514, 0.807)] + [a.tokens]
    a.blocks = -(-a.tokens // BS) + 8
    a.secret_file = str(Path(tempfile.mkdtemp()) / "side-channel.key")
    Path(a.secret_file).write_text(os.urandom(32).hex() + "\n")
    watch = None
    if a.device == "cuda":
        assert torch.cuda.is_available(), "no CUDA device"
        watch = SyncWatch()
        watch.install()
        print(
            f"# {torch.cuda.get_device_name()} torch {torch.__version__}; vLLM stubbed: {STUBBED}",
            flush=True,
        )
    a.repeat = calibrate(a)
    print(
        f"# {a.layers} layers, {a.tokens} tokens in chunks ending at {a.bounds}, "
        f"{a.heads} KV heads x {a.head}, bf16; {a.repeat} matmul(s) per layer",
        flush=True,
    )
    only = SEALED_PAIRS if a.only == "sealed" else a.only
    order = [int(x) for x in only.split(",") if x] or list(range(1, len(CASES) + 1))
    results = []
    for i in order * a.rounds:
        case = CASES[i - 1]
        r = run_case(case, a, watch)
        results.append(r)
        print(json.dumps(asdict(r)), flush=True)
    print(
        "\n| case | MiB | pieces/layer/chunk | writes | push ms | compute ms | exposed ms "
        "| hidden | connector says | D done after compute | sender waits (event/stream/"
        "device) | exact |\n|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|---|"
    )
    for r in results:
        w = r.sender_waits
        print(
            f"| {r.case} | {r.mb:.0f} | {r.pieces} | {r.writes} | {r.push_ms:.1f} | "
            f"{r.compute_ms:.1f} | {r.exposed_ms:.2f} | {r.hidden:.1%} | "
            f"{r.connector_hidden:.1%} | {r.d_done_after_ms:.1f} ms | "
            f"{w.get('event', '-')}/{w.get('stream', '-')}/{w.get('device', '-')} | "
            f"{'yes' if r.exact else 'NO'} |"
        )
    if a.json:
        a.json.write_text(json.dumps([asdict(r) for r in results], indent=2))
    ok = all(r.exact for r in results)
    if watch:
        ok = ok and all(
            r.sender_waits.get("stream", 0) == r.sender_waits.get("device", 0) == 0 for r in results
        )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
