"""pd-launch for real: it reports progress, prints a curl that works, and Ctrl-C stops every
process it started (no orphans)."""

from __future__ import annotations

import re
import shlex
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from launch.supervisor import group_alive
from tests.e2e.conftest import LOG_DIR
from tests.e2e.stack import ENGINE_ARGS
from tests.support.procs import VENV_BIN, free_port_block

pytestmark = pytest.mark.e2e


def test_e2e_pd_launch_serves_then_stops_everything_on_ctrl_c(tiny_model: Path) -> None:
    # one block: pd-launch counts engine and side-channel ports up from their bases, and two
    # independent free_port() bases can meet (a CI run: decode-0's HTTP port was taken)
    base = free_port_block(16)
    ports = [str(base), str(base + 1), str(base + 2), str(base + 8)]
    argv = [
        str(VENV_BIN / "pd-launch"), "--model", str(tiny_model), "--port", ports[0],
        "--metaserver-port", ports[1], "--engine-base-port", ports[2],
        "--side-channel-base-port", ports[3], "--log-dir", str(LOG_DIR / "pd-launch"),
        "--max-model-len", "1024", *(f"--engine-arg={a}" for a in ENGINE_ARGS),
    ]  # fmt: skip
    proc = subprocess.Popen(
        argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
    )
    lines: list[str] = []
    up = threading.Event()

    def read() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.append(line.rstrip())
            print(f"[pd-launch] {line.rstrip()}", file=sys.stderr, flush=True)
            if "Ctrl-C stops everything" in line:
                up.set()

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        deadline = time.monotonic() + 900
        while not up.wait(0.5):  # a pd-launch that exited (a child failed) is not waited for
            ended = proc.poll() is not None or time.monotonic() > deadline
            assert not ended, "pd-launch never became ready:\n" + "\n".join(lines[-30:])
        text = "\n".join(lines)
        pids = [int(p) for p in re.findall(r"\(pid (\d+)\)", text)]
        assert len(pids) == 4  # metaserver, prefill-0, decode-0, proxy
        assert "prefill-0 is ready" in text and "decode-0 is ready" in text
        curl = next(i for i, line in enumerate(lines) if line.strip().startswith("curl -s"))
        command = lines[curl].strip().rstrip("\\") + " " + lines[curl + 1].strip()
        answer = subprocess.run(shlex.split(command), capture_output=True, text=True, timeout=120)
        assert '"choices"' in answer.stdout, answer.stdout + answer.stderr
        proc.send_signal(signal.SIGINT)
        assert proc.wait(60) == 0
    finally:
        if proc.poll() is None:  # a failed assertion: still stop it the way a user would
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(10)
    reader.join(10)
    if proc.stdout is not None:
        proc.stdout.close()
    assert "all processes stopped" in "\n".join(lines)
    deadline = time.monotonic() + 10
    while any(group_alive(pid) for pid in pids):
        assert time.monotonic() < deadline, "pd-launch left processes behind"
        time.sleep(0.1)
