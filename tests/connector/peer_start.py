"""The start-up handoff of the two-process Mooncake tests' peers: both start at once (each
imports vLLM, 20-30 s on a busy 2-core machine), D writes ``--ready-file`` once its caches are
registered and its loads expected, and P, imported meanwhile, waits for that file (``--after``)
before it pushes. The test then waits for one import, not two in a row."""

from __future__ import annotations

import argparse
import time
from pathlib import Path

WAIT_S = 240.0  # D's imports on a loaded machine, and then some


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--ready-file", default="", help="D: written once D is READY")
    ap.add_argument("--after", default="", help="P: wait for this file before pushing")


def ready(a: argparse.Namespace) -> None:
    print("READY", flush=True)
    if a.ready_file:
        Path(a.ready_file).write_text("ready\n")


def wait_for_d(a: argparse.Namespace) -> None:
    if not a.after:
        return
    deadline = time.monotonic() + WAIT_S
    while not Path(a.after).exists():
        if time.monotonic() > deadline:
            raise SystemExit(f"D never became ready: no {a.after} after {WAIT_S:.0f}s")
        time.sleep(0.05)
