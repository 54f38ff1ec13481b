"""Run a fake vLLM server in a subprocess and drive it over HTTP (tests and benchmarks)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import httpx

from tests.support.procs import Process, free_port, wait_http


class FakeVLLM:
    """``FakeVLLM("decode", metaserver=url)``; ``.url``, ``.configure(...)``, ``.stop()``."""

    def __init__(
        self,
        role: str,
        *,
        metaserver: str | None = None,
        log_dir: Path | None = None,
        port: int | None = None,
        instance_id: str | None = None,
        extra: list[str] | None = None,
        module: str = "tests.fakes.vllm",
        env: dict[str, str] | None = None,
    ) -> None:
        """``module``: the fake to run (``tests.fakes.ascend`` for vllm-ascend's engines);
        ``env``: its environment's additions (``VLLM_API_KEY`` as for vLLM)."""
        self.role = role
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.instance_id = instance_id or f"{role}-{self.port}"
        argv = [sys.executable, "-m", module, "--role", role, "--port", str(self.port)]
        argv += ["--instance-id", self.instance_id]
        if metaserver:
            argv += ["--metaserver", metaserver]
        argv += extra or []
        log = log_dir / f"fake-{role}-{self.port}.log" if log_dir else None
        self.proc = Process(argv, env=env, log=log)
        wait_http(self.url + "/health", proc=self.proc)

    def configure(self, **knobs: Any) -> dict[str, Any]:
        r = httpx.post(self.url + "/_fake/config", json=knobs, timeout=5)
        r.raise_for_status()
        return dict(r.json())

    def reset(self) -> None:
        httpx.post(self.url + "/_fake/reset", timeout=5).raise_for_status()

    def requests(self) -> list[dict[str, Any]]:
        return list(httpx.get(self.url + "/_fake/requests", timeout=5).json())

    def stats(self) -> dict[str, Any]:
        return dict(httpx.get(self.url + "/_fake/stats", timeout=5).json())

    def stop(self) -> None:
        self.proc.stop()
