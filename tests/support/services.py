"""Real redis-server and pd-metaserver processes for tests."""

from __future__ import annotations

import shutil
from pathlib import Path

from tests.support.procs import VENV_BIN, Process, free_port, wait_http, wait_port


class RedisServer:
    """redis-server on a free loopback port, with append-only persistence (fsync always) so
    that a restart keeps every acknowledged write — the setting docs/metaserver.md recommends."""

    def __init__(self, workdir: Path) -> None:
        exe = shutil.which("redis-server")
        if exe is None:
            raise RuntimeError("redis-server not installed (make install does it)")
        self.exe = exe
        self.workdir = workdir
        self.port = free_port()
        self.proc: Process | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        self.workdir.mkdir(parents=True, exist_ok=True)
        argv = [
            self.exe,
            "--port",
            str(self.port),
            "--bind",
            "127.0.0.1",
            "--save",
            "",
            "--appendonly",
            "yes",
            "--appendfsync",
            "always",
            "--dir",
            str(self.workdir),
            "--protected-mode",
            "no",
        ]
        self.proc = Process(argv, log=self.workdir / "redis.log")
        wait_port(self.port)

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.stop()
            self.proc = None


class MetaserverProcess:
    def __init__(self, store: str, *extra: str, log_dir: Path, port: int | None = None) -> None:
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        argv = [str(VENV_BIN / "pd-metaserver"), "--port", str(self.port), "--store", store, *extra]
        self.proc = Process(argv, log=log_dir / f"metaserver-{self.port}.log")
        wait_http(self.url + "/health", proc=self.proc)

    def stop(self) -> None:
        self.proc.stop()
