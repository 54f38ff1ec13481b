"""``pd-proxy --workers N`` handed its settings to the workers as JSON in the environment, every
secret revealed (security_review M5, left over): keys given in a file (``--config``,
``--engine-api-key-file``) ended in every process's environment, readable in ``/proc`` and in
crash dumps. Now each worker loads the parent's command line again; secrets stay where the
operator put them."""

from __future__ import annotations

import subprocess
from pathlib import Path

import httpx

from tests.fakes.control import FakeVLLM
from tests.fakes.render import MODEL
from tests.support.procs import until
from tests.support.services import ProxyProcess

API_KEY = "client-key-from-a-config-file"
ENGINE_KEY = "engine-key-from-a-file-0123"


def _environ(pid: int) -> bytes:
    return Path(f"/proc/{pid}/environ").read_bytes()


def _workers(parent: int) -> list[int]:
    out = subprocess.run(["pgrep", "-P", str(parent)], capture_output=True, text=True).stdout
    return [int(p) for p in out.split()]


def test_worker_processes_get_no_secret_in_their_environment(tmp_path: Path) -> None:
    d = FakeVLLM("decode", log_dir=tmp_path, env={"VLLM_API_KEY": ENGINE_KEY})
    config = tmp_path / "proxy.yaml"
    config.write_text(f"api_keys: [{API_KEY}]\n")
    key_file = tmp_path / "engine.key"
    key_file.write_text(ENGINE_KEY + "\n")
    try:
        proxy = ProxyProcess(
            "--config", str(config), "--engine-api-key-file", str(key_file), "--workers", "2",
            "--decode", d.url, "--flow", "direct", log_dir=tmp_path,
        )  # fmt: skip
        try:
            until(lambda: len(_workers(proxy.proc.pid)) >= 2, 30)
            body = {"model": MODEL, "prompt": "hi", "max_tokens": 2}
            for _ in range(6):  # answered by either worker, each with both keys
                r = httpx.post(
                    f"{proxy.url}/v1/completions", json=body, timeout=20,
                    headers={"authorization": f"Bearer {API_KEY}"},
                )  # fmt: skip
                assert r.status_code == 200, r.text
            for pid in [proxy.proc.pid, *_workers(proxy.proc.pid)]:
                environ = _environ(pid)
                assert API_KEY.encode() not in environ and ENGINE_KEY.encode() not in environ
        finally:
            proxy.stop()
    finally:
        d.stop()
