"""P and D in two OS processes over the real Mooncake TCP transport on loopback, with KV caches
allocated by vLLM's own CPU allocator: D's blocks must hold exactly P's bytes."""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

import mooncake.engine  # noqa: F401 - `make install` installs it (the vllm-cpu extra pins it)
import pytest
import torch

from tests.connector.cluster import free_port_range
from tests.connector.mooncake_peer import LAYERS, expected
from tests.support.procs import Process, free_port
from tests.support.sealing import key_file

pytestmark = pytest.mark.slow  # two processes that import vLLM per test: not in `make test-fast`

PEER = [sys.executable, "-m", "tests.connector.mooncake_peer"]


@pytest.fixture(scope="module", autouse=True)
def _one_key() -> None:
    key_file()  # made before the peers start: both read it (its path is in the environment)


def _wait_line(proc: Process, text: str, timeout: float = 60.0) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for line in proc.tail(200).splitlines():
            if line.startswith(text):
                return line
        if not proc.alive():
            raise AssertionError(f"peer exited early:\n{proc.tail()}")
        time.sleep(0.05)
    raise AssertionError(f"no {text!r} from peer:\n{proc.tail()}")


Chunks = list[list[tuple[int, int]]]  # per chunk: (P block, D block) pairs
SEED = 1
# Two transfers pushed one after the other by one pair of processes (each process imports
# vLLM: sharing them saves a minute of this 2-core machine per test). D's blocks of the two
# are disjoint. The first: one chunk. The second: blocks 0-1 are cached on D (never sent),
# three chunks, the last with the tail block.
SINGLE: Chunks = [[(0, 5), (1, 6), (2, 7), (3, 11)]]
SEVERAL: Chunks = [[(2, 12), (3, 13)], [(4, 14), (5, 20), (6, 21)], [(7, 22)]]


def _run(tmp_path: Path, transfers: list[Chunks], seed: int) -> dict[str, torch.Tensor]:
    port = free_port()
    out = tmp_path / "d.pt"
    ready = tmp_path / "d.ready"
    tids = ",".join(f"t{seed}-{n}" for n in range(len(transfers)))
    dst = "/".join(",".join(str(d) for chunk in t for _, d in chunk) for t in transfers)
    spec = "/".join(
        ";".join(",".join(f"{s}:{d}" for s, d in chunk) for chunk in t) for t in transfers
    )
    # both start at once (each imports vLLM); P pushes once D has written ``ready``
    d = Process(
        [*PEER, "d", "--port", str(port), "--tid", tids, "--dst", dst,
         "--out", str(out), "--ready-file", str(ready), "--timeout", "120"],
        log=tmp_path / "d.log",
    )  # fmt: skip
    p = Process(
        [*PEER, "p", "--d-port", str(port), "--tid", tids, "--chunks", spec,
         "--seed", str(seed), "--after", str(ready)],
        log=tmp_path / "p.log",
    )  # fmt: skip
    try:
        _wait_line(d, "READY", timeout=240)
        _wait_line(p, "STARTED", timeout=240)
        _wait_line(p, "SENT")
        assert _wait_line(d, "RECEIVED").startswith("RECEIVED ok")
        deadline = time.monotonic() + 20
        while d.alive() and time.monotonic() < deadline:
            time.sleep(0.05)
        got: dict[str, torch.Tensor] = torch.load(out)
        return got
    finally:
        d.stop()
        p.stop()


@pytest.fixture(scope="module")
def pushed(tmp_path_factory: pytest.TempPathFactory) -> dict[str, torch.Tensor]:
    """D's KV caches after P pushed SINGLE, then SEVERAL."""
    return _run(tmp_path_factory.mktemp("mooncake"), [SINGLE, SEVERAL], seed=SEED)


def _assert_placed(got: dict[str, torch.Tensor], chunks: Chunks) -> None:
    """``chunks`` landed exactly, and no block either transfer did not write was touched."""
    want = expected(SEED, tuple(got[LAYERS[0]].shape), LAYERS)
    pairs = [pair for chunk in chunks for pair in chunk]
    written = {d for t in (SINGLE, SEVERAL) for chunk in t for _, d in chunk}
    for name in LAYERS:
        for s, d in pairs:
            assert torch.equal(got[name][d], want[name][s]), (name, s, d)
        for b in range(got[name].shape[0]):
            if b not in written:
                assert not got[name][b].any(), (name, b)


def test_mooncake_push_single_chunk_lands_exactly(pushed: dict[str, torch.Tensor]) -> None:
    _assert_placed(pushed, SINGLE)


def test_mooncake_push_several_chunks_tail_and_skipped_cached_blocks(
    pushed: dict[str, torch.Tensor],
) -> None:
    _assert_placed(pushed, SEVERAL)


def test_mooncake_handshake_to_a_dead_decoder_fails_without_hanging(tmp_path: Path) -> None:
    port = free_port()
    dead = tmp_path / "d.dead"  # P pushes once D has been killed
    d = Process(
        [*PEER, "d", "--port", str(port), "--tid", "tdead", "--dst", "1"], log=tmp_path / "d.log"
    )
    p = Process(
        [*PEER, "p", "--d-port", str(port), "--tid", "tdead", "--chunks", "0:1",
         "--after", str(dead)],
        log=tmp_path / "p.log",
    )  # fmt: skip
    try:
        try:
            _wait_line(d, "READY", timeout=240)
        finally:
            d.stop(signal.SIGKILL)
        dead.write_text("killed\n")
        _wait_line(p, "STARTED", timeout=240)  # its imports are not what is timed
        line = _wait_line(p, "SENT", timeout=30)  # P releases its blocks: no hang
        assert "writes=0" in line
    finally:
        p.stop()


@pytest.mark.parametrize(
    ("p_tp", "d_tp"), [(1, 1), (2, 1), (1, 2)], ids=["tp1to1", "tp2to1", "tp1to2"]
)
def test_mooncake_push_between_every_pair_of_vllm_layouts(
    tmp_path: Path, p_tp: int, d_tp: int
) -> None:
    """P workers in each ``KVCacheLayout`` (``p_tp`` ranks apiece) push into six D instances,
    one per layout (``d_tp`` ranks apiece), in another process: every D layout holds, in its
    logical view over all its ranks, exactly the blocks P holds in its own."""
    from tests.connector import layout_peer as L

    port = free_port_range(len(L.LAYOUTS) * d_tp)
    out = tmp_path / "d.pt"
    ready = tmp_path / "d.ready"
    layout_peer = [sys.executable, "-m", "tests.connector.layout_peer"]
    # both start at once (each imports vLLM); P pushes once D has written ``ready``
    d = Process(
        [*layout_peer, "d", "--port", str(port), "--out", str(out), "--d-tp", str(d_tp),
         "--ready-file", str(ready)],
        log=tmp_path / "d.log",
    )  # fmt: skip
    p = Process(
        [*layout_peer, "p", "--d-port", str(port), "--tp", str(p_tp), "--d-tp", str(d_tp),
         "--after", str(ready)],
        log=tmp_path / "p.log",
    )  # fmt: skip
    try:
        _wait_line(d, "READY", timeout=240)
        assert _wait_line(d, "RECEIVED", timeout=150) == "RECEIVED pending=0 failed=0"
        deadline = time.monotonic() + 30
        while d.alive() and time.monotonic() < deadline:
            time.sleep(0.05)
        got: dict[tuple[str, str], torch.Tensor] = torch.load(out)
    finally:
        d.stop()
        p.stop()
    for li, name in enumerate(L.LAYERS):
        want = L.logical_kv(li)
        for y in L.LAYOUTS:
            blocks = got[(y, name)]  # [blocks, H, N, C] of D layout y
            written = set()
            for j, x in enumerate(L.LAYOUTS):
                for pb, off in (pair for chunk in L.CHUNKS for pair in chunk):
                    db = j * L.SPAN + off
                    written.add(db)
                    assert torch.equal(blocks[db], want[pb]), (x, y, name, pb, db)
            for b in set(range(L.BLOCKS)) - written:
                assert not blocks[b].any(), (y, name, b)


RAW = [sys.executable, "-m", "tests.connector.mooncake_raw"]


def test_mooncake_write_to_a_frozen_decoder_fails_within_write_timeout(tmp_path: Path) -> None:
    """A tcp write whose receiver stops answering (SIGSTOP: what a stalled lane looks like from
    P) fails after ``write_timeout_s`` instead of Mooncake's default 30 s, so the sender can
    retry; once the receiver runs again, a write succeeds within the sender's default retries
    (the first attempt can fail at once on the connection the stall dropped)."""
    d = Process([*RAW, "recv"], log=tmp_path / "recv.log")
    p: Process | None = None
    go = tmp_path / "go"
    try:
        _, session, addr = _wait_line(d, "READY").split()
        argv = [*RAW, "send", "--to", session, "--addr", addr, "--timeout", "5", "--go", str(go)]
        p = Process(argv, log=tmp_path / "send.log")
        _wait_line(p, "FIRST ok")
        os.kill(d.pid, signal.SIGSTOP)
        (tmp_path / "go.2").touch()
        outcome, seconds, _ = _wait_line(p, "SECOND", timeout=25).split()[1:4]
        assert outcome == "failed" and 4.5 <= float(seconds) < 15, (outcome, seconds)
        os.kill(d.pid, signal.SIGCONT)
        (tmp_path / "go.3").touch()
        outcome, seconds, attempts = _wait_line(p, "THIRD", timeout=25).split()[1:4]
        assert outcome == "ok" and float(seconds) < 4.5, (outcome, seconds, attempts)
    finally:
        if d.alive():
            os.kill(d.pid, signal.SIGCONT)
        d.stop()
        if p is not None:
            p.stop()
