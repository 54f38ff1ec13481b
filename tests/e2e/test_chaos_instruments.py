"""The chaos suite's own instruments (``tests/e2e/chaos.py``) that can be checked without a
deployment."""

from __future__ import annotations

import os
import signal
import subprocess

from tests.e2e.chaos import StallWatch

STOPPED_S = 0.8


def test_stall_watch_measures_the_time_this_process_was_stopped() -> None:
    # the helper waits until this process is stopped, then continues it STOPPED_S later: the
    # stop lasts that long however slow the machine is between the two calls below
    pid = os.getpid()
    script = (
        f"while ! grep -q '^State:[[:space:]]*T' /proc/{pid}/status; do sleep 0.01; done; "
        f"sleep {STOPPED_S}; kill -CONT {pid}"
    )
    resume = subprocess.Popen(["sh", "-c", script])
    try:
        with StallWatch() as watch:
            os.kill(pid, signal.SIGSTOP)
    finally:
        resume.wait(30)
    assert STOPPED_S - 0.1 <= watch.worst_s < 30, watch.worst_s
