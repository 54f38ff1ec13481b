"""D's receive tracker under a flood of made-up transfers: its ``poll`` (run every engine step)
before and after the early entries were capped and indexed by expiry, in the same run.

    .venv/bin/python tests/bench/recv_tracker_bench.py [--baseline-rev 2badf9d] [--polls 20]

The baseline is ``connector/worker/receiver.py`` as of ``--baseline-rev`` (read with ``git
show``), driven with the same messages. Each row: the keep-alives' made-up transfer ids
(``Alive`` messages of 4,096 ids each), and 256 loads D really waits for; columns: the time to
take the keep-alives in, the entries each tracker then holds, and the median cost of one
``poll`` (microseconds). Review 2 measured one 2.7 MB ``Alive`` with 300,000 ids: ~1 s added
to every D step for the deadline's two minutes.
"""

from __future__ import annotations

import argparse
import importlib.util
import logging
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import ModuleType
from typing import Any

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from connector import wire  # noqa: E402
from connector.worker import receiver  # noqa: E402

PER_MESSAGE = 4096  # ids per Alive (what the side channel takes now; the baseline took any)
LOADS = 256  # requests D waits for while the flood sits in its tracker
FLOODS = (0, 4096, 30_000, 300_000)


def baseline_module(rev: str) -> ModuleType:
    """``connector/worker/receiver.py`` at ``rev``, imported under another name."""
    source = subprocess.run(
        ["git", "show", f"{rev}:connector/worker/receiver.py"],
        cwd=REPO, capture_output=True, text=True, check=True,
    ).stdout  # fmt: skip
    path = Path(tempfile.mkdtemp(prefix="recv-bench-")) / "baseline_receiver.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location("baseline_receiver", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # (its dataclasses look their module up)
    spec.loader.exec_module(module)
    return module


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def held(tracker: Any) -> int:
    return len(tracker._signals)


def row(tracker_class: Any, flood: int, polls: int) -> tuple[float, int, float]:
    """(ms to take the flood in, entries held, median µs per poll)."""
    clock = Clock()
    tracker = tracker_class(120.0, clock)
    for i in range(LOADS):
        tracker.expect(f"req-{i}", f"real-{i}")
    ids = [f"forged-{i:032x}" for i in range(flood)]
    t0 = time.perf_counter()
    for start in range(0, flood, PER_MESSAGE):
        tracker.on_alive(wire.Alive("evil/0", ids[start : start + PER_MESSAGE]))
    absorb_ms = (time.perf_counter() - t0) * 1e3
    samples = []
    for _ in range(polls):
        clock.now += 0.05  # an engine step; nothing is due for two minutes
        t0 = time.perf_counter()
        tracker.poll()
        samples.append((time.perf_counter() - t0) * 1e6)
    return absorb_ms, held(tracker), statistics.median(samples)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--baseline-rev", default="2badf9d", help="the tracker before the cap")
    ap.add_argument("--polls", type=int, default=20, help="polls timed per row")
    ap.add_argument("--max-flood", type=int, default=FLOODS[-1], help="largest flood row")
    a = ap.parse_args()
    logging.getLogger("pdgate").setLevel(logging.ERROR)  # the flood's one warning, per tracker
    before = baseline_module(a.baseline_rev).RecvTracker
    after = receiver.RecvTracker
    print(f"{'made-up ids':>11} {'take-in ms':>11} {'held':>8} {'poll µs':>10}   "
          f"{'take-in ms':>11} {'held':>8} {'poll µs':>10}")  # fmt: skip
    print(f"{'':>11} {'before (' + a.baseline_rev + ')':>31}   {'after':>31}")
    for flood in [f for f in FLOODS if f <= a.max_flood]:
        b = row(before, flood, a.polls)
        n = row(after, flood, a.polls)
        print(f"{flood:>11,} {b[0]:>11.1f} {b[1]:>8,} {b[2]:>10.0f}   "
              f"{n[0]:>11.1f} {n[1]:>8,} {n[2]:>10.0f}", flush=True)  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
