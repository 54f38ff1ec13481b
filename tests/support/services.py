"""Real redis-server and pd-metaserver processes for tests."""

from __future__ import annotations

import shutil
import time
from collections.abc import Callable
from pathlib import Path

from tests.support.procs import VENV_BIN, Process, free_port, wait_http, wait_port


class RedisServer:
    """redis-server on a free loopback port, with append-only persistence (fsync always) so
    that a restart keeps every acknowledged write — the setting docs/metaserver.md recommends."""

    def __init__(self, workdir: Path, replica_of: int | None = None) -> None:
        exe = shutil.which("redis-server")
        if exe is None:
            raise RuntimeError("redis-server not installed (make install does it)")
        self.exe = exe
        self.workdir = workdir
        self.port = free_port()
        self.replica_of = replica_of  # the master's port, for a replica
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
        if self.replica_of is not None:
            argv += ["--replicaof", "127.0.0.1", str(self.replica_of)]
        self.proc = Process(argv, log=self.workdir / "redis.log")
        wait_port(self.port)

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.stop()
            self.proc = None


class RedisSentinelGroup:
    """A master, a replica and one Sentinel (quorum 1) on loopback: the smallest set that can
    fail over, with Sentinel's timeouts cut to seconds (down after 0.5 s unless told)."""

    SERVICE = "pdgate"

    def __init__(self, workdir: Path, down_after_ms: int = 500) -> None:
        self.workdir = workdir
        self.down_after_ms = down_after_ms
        self.master = RedisServer(workdir / "master")
        self.replica = RedisServer(workdir / "replica", replica_of=self.master.port)
        self.port = free_port()
        self.proc: Process | None = None

    @property
    def url(self) -> str:
        return f"redis+sentinel://127.0.0.1:{self.port}/{self.SERVICE}/0"

    def start(self, timeout: float = 30.0) -> None:
        self.master.start()
        self.replica.start()
        conf = self.workdir / "sentinel.conf"  # Sentinel rewrites its config file: a fresh one
        conf.write_text(
            f"port {self.port}\nbind 127.0.0.1\nprotected-mode no\ndir {self.workdir}\n"
            f"sentinel monitor {self.SERVICE} 127.0.0.1 {self.master.port} 1\n"
            f"sentinel down-after-milliseconds {self.SERVICE} {self.down_after_ms}\n"
            f"sentinel failover-timeout {self.SERVICE} 3000\n"
        )
        self.proc = Process(
            [self.master.exe, str(conf), "--sentinel"], log=self.workdir / "sentinel.log"
        )
        wait_port(self.port)
        self._until(self._ready, timeout, "the replica to sync and Sentinel to see it")

    def _ready(self) -> bool:
        import redis

        replica = redis.Redis(port=self.replica.port)
        sentinel = redis.Redis(port=self.port)
        try:
            linked = replica.info("replication").get("master_link_status") == "up"
            known = sentinel.sentinel_slaves(self.SERVICE)
            return bool(linked and known and "s_down" not in str(known[0].get("flags", "")))
        finally:
            replica.close()
            sentinel.close()

    def master_port(self) -> int:
        import redis

        sentinel = redis.Redis(port=self.port, decode_responses=True)
        try:
            addr = sentinel.sentinel_get_master_addr_by_name(self.SERVICE)
            assert isinstance(addr, tuple), addr
            return int(addr[1])
        finally:
            sentinel.close()

    @staticmethod
    def _until(cond: Callable[[], bool], timeout: float, what: str) -> None:
        deadline = time.monotonic() + timeout
        while not cond():
            if time.monotonic() > deadline:
                raise TimeoutError(f"timed out waiting for {what}")
            time.sleep(0.1)

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.stop()
            self.proc = None
        self.replica.stop()
        self.master.stop()


class MetaserverProcess:
    def __init__(
        self,
        store: str,
        *extra: str,
        log_dir: Path,
        port: int | None = None,
        ready_timeout_s: float = 30.0,
    ) -> None:
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        argv = [str(VENV_BIN / "pd-metaserver"), "--port", str(self.port), "--store", store, *extra]
        self.proc = Process(argv, log=log_dir / f"metaserver-{self.port}.log")
        try:
            wait_http(self.url + "/health", proc=self.proc, timeout=ready_timeout_s)
        except BaseException:
            self.proc.stop()  # nobody else holds it yet: it would outlive the test
            raise

    def stop(self) -> None:
        self.proc.stop()


class InThreadMetaserver:
    """The metaserver's own app (``create_app``, memory store) served by uvicorn on a loopback
    socket from a thread of this process: real HTTP, a fresh store each time, and none of a
    ``pd-metaserver`` process's 3-4 s of start-up (importing FastAPI) per test. For tests that
    only talk to it; a test that kills or restarts the metaserver uses ``MetaserverProcess``."""

    def __init__(
        self, token: str = "", ready_timeout_s: float = 30.0, *, protect_reads: bool = True
    ) -> None:
        import socket
        import threading

        import uvicorn

        from metaserver.app import create_app
        from metaserver.config import MetaserverSettings

        app = create_app(
            MetaserverSettings(store="memory", token=token, protect_reads=protect_reads)
        )
        self._sock = socket.socket()
        self._sock.bind(("127.0.0.1", 0))
        self.port = int(self._sock.getsockname()[1])
        self.url = f"http://127.0.0.1:{self.port}"
        # a long-poll its client gave up on is still held by the server until its wait ends:
        # stopping waits for it at most a second (not the 10 s join below)
        config = uvicorn.Config(
            app, loop="asyncio", log_level="warning", access_log=False, lifespan="on",
            timeout_graceful_shutdown=1,
        )  # fmt: skip
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(
            target=self._server.run, kwargs={"sockets": [self._sock]}, daemon=True,
            name=f"metaserver-{self.port}",
        )  # fmt: skip
        self._thread.start()
        deadline = time.monotonic() + ready_timeout_s
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"the in-thread metaserver on {self.url} did not start")
            time.sleep(0.01)

    def stop(self) -> None:
        self._server.should_exit = True
        self._thread.join(timeout=10)
        self._sock.close()


class ProxyProcess:
    """A ``pd-proxy`` process on a free loopback port, up once its ``/health`` answers (any
    status below 500, or 503 while no instance is selectable yet)."""

    def __init__(
        self, *extra: str, log_dir: Path, env: dict[str, str] | None = None,
        ready_timeout_s: float = 30.0,
    ) -> None:  # fmt: skip
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        argv = [str(VENV_BIN / "pd-proxy"), "--port", str(self.port), *extra]
        self.proc = Process(argv, env=env, log=log_dir / f"proxy-{self.port}.log")
        try:
            wait_http(self.url + "/metrics", proc=self.proc, timeout=ready_timeout_s)
        except BaseException:
            self.proc.stop()
            raise

    def stop(self) -> None:
        self.proc.stop()
