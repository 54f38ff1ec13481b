"""Start real processes for tests and always stop them (whole process group)."""

from __future__ import annotations

import os
import random
import signal
import socket
import ssl
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[2]
VENV_BIN = Path(sys.executable).parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def free_port_block(n: int) -> int:
    """The first of ``n`` consecutive ports that are free now, below the kernel's ephemeral
    range (where ``free_port`` and outgoing connections draw from) and away from Mooncake's
    own ports (12000-17999). Ports of one deployment come from one block, so its ranges (engine
    HTTP ports, side channels) cannot overlap each other — two independent ``free_port()``
    bases can (CI once saw decode-0's side channel take its own HTTP port)."""
    rng = random.Random()
    for _ in range(500):
        base = rng.randrange(20000, 32000 - n)
        if all(_bindable(p) for p in range(base, base + n)):
            return base
    raise RuntimeError(f"no {n} consecutive free ports")


def _bindable(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


class Process:
    """A child process in its own process group; ``stop()`` kills the group."""

    def __init__(
        self, argv: Sequence[str], *, env: dict[str, str] | None = None, log: Path | None = None
    ) -> None:
        self.argv = list(argv)
        self.log_path = log
        out = open(log, "ab") if log else subprocess.DEVNULL
        self.proc = subprocess.Popen(
            self.argv,
            env={**os.environ, **(env or {})},
            stdout=out,
            stderr=subprocess.STDOUT,
            process_group=0,
            cwd=REPO,
        )
        if log:
            out.close()  # type: ignore[union-attr]

    @property
    def pid(self) -> int:
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc.poll() is None

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 10.0) -> None:
        if self.proc.poll() is not None:
            return
        try:
            os.killpg(self.proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(5)

    def tail(self, n: int = 40) -> str:
        if not self.log_path or not self.log_path.exists():
            return ""
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])


def wait_http(
    url: str,
    timeout: float = 30.0,
    proc: Process | None = None,
    verify: ssl.SSLContext | bool = True,
) -> None:
    """Until ``url`` answers below 500 (``verify``: how an https URL's certificate is
    checked)."""
    deadline = time.monotonic() + timeout
    last: object = None
    while time.monotonic() < deadline:
        if proc is not None and not proc.alive():
            raise RuntimeError(f"{proc.argv[0]} exited early:\n{proc.tail()}")
        try:
            if httpx.get(url, timeout=1.0, verify=verify).status_code < 500:
                return
        except httpx.HTTPError as exc:
            last = exc
        time.sleep(0.05)
    raise TimeoutError(f"{url} not up after {timeout}s ({last})")


def until(cond: Callable[[], bool], limit_s: float = 5.0) -> None:
    """Poll ``cond`` every 10 ms until it holds; fail after ``limit_s``."""
    end = time.monotonic() + limit_s
    while time.monotonic() < end:
        if cond():
            return
        time.sleep(0.01)
    raise AssertionError("condition not met in time")


def wait_port(port: int, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.02)
    raise TimeoutError(f"port {port} not listening after {timeout}s")
