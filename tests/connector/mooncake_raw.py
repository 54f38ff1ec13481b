"""Bare Mooncake endpoints for the transport tests: a receiver that only registers memory, and a
sender driving pdgate's ``MooncakeTransport`` (so its deadline settings are what is tested).

    python -m tests.connector.mooncake_raw recv
    python -m tests.connector.mooncake_raw send --to SESSION --addr ADDR --timeout S --go FILE

The receiver prints ``READY <session> <addr>``. The sender writes once (``FIRST ok``), then for
``SECOND`` and ``THIRD``: waits for the file ``--go`` + ``.2`` / ``.3``, writes, and prints
``<NAME> ok|failed <seconds> <attempts>``. ``SECOND`` is one attempt (it times the deadline);
``THIRD`` retries a failed write as P's sender does, up to ``write_retries`` more times (the
first write after a lane was dropped can fail at once, on the dead connection).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import numpy as np

from connector.config import ConnectorSettings
from connector.errors import TransferError
from connector.transport.mooncake import MooncakeTransport

PIECE = 16384
RETRIES = ConnectorSettings.model_fields["write_retries"].default


def _say(line: str) -> None:
    """One line in one write(2): Mooncake's glog lines go to the same log from its own threads,
    and a ``print`` (text, then newline) could be split by one (a CI run read
    ``SECOND failed 5.00 1E1123 …``)."""
    os.write(1, f"{line}\n".encode())


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("mode", choices=["recv", "send"])
    ap.add_argument("--to", default="")
    ap.add_argument("--addr", type=int, default=0)
    ap.add_argument("--timeout", type=int, default=10)
    ap.add_argument("--go", default="")
    args = ap.parse_args(argv)
    transport = MooncakeTransport("127.0.0.1", "tcp", "", args.timeout)
    buf = np.zeros(1 << 20, dtype=np.uint8)
    transport.register(buf.ctypes.data, buf.nbytes)
    if args.mode == "recv":
        _say(f"READY {transport.session} {buf.ctypes.data}")
        time.sleep(3600)
        return 0
    src = [buf.ctypes.data + i * PIECE for i in range(4)]
    dst = [args.addr + i * PIECE for i in range(4)]
    transport.write(args.to, src[:1], dst[:1], [PIECE])
    _say("FIRST ok")
    for n, name in ((2, "SECOND"), (3, "THIRD")):
        while not Path(f"{args.go}.{n}").exists():
            time.sleep(0.02)
        t0 = time.monotonic()
        outcome, attempts = "failed", 0
        while outcome == "failed" and attempts <= (RETRIES if n == 3 else 0):
            attempts += 1
            try:
                transport.write(args.to, src, dst, [PIECE] * 4)
                outcome = "ok"
            except TransferError:
                pass
        _say(f"{name} {outcome} {time.monotonic() - t0:.2f} {attempts}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
