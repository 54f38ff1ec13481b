"""An open metaserver (no ``--token``, no ``--credentials-file``) makes everyone who reaches it
admin. The CLI, ``pd-launch`` and the image all started one, and the image on 0.0.0.0; only an
INFO line said so. Now ``pd-metaserver`` refuses a non-loopback address without credentials
unless ``--insecure-open``, warns at every open start, and protects reads by default."""

from __future__ import annotations

import subprocess
from pathlib import Path

import httpx

from tests.support.procs import VENV_BIN, free_port
from tests.support.services import MetaserverProcess


def _start(*argv: str) -> subprocess.CompletedProcess[str]:
    """Run ``pd-metaserver`` until it exits or for 8 s (a refusal exits at once)."""
    try:
        return subprocess.run(
            [str(VENV_BIN / "pd-metaserver"), "--port", str(free_port()), *argv],
            capture_output=True, text=True, timeout=8,
        )  # fmt: skip
    except subprocess.TimeoutExpired as exc:
        out = exc.stderr.decode() if isinstance(exc.stderr, bytes) else str(exc.stderr)
        return subprocess.CompletedProcess(exc.cmd, -1, "", out)


def test_an_open_metaserver_listens_on_loopback_only_unless_asked_by_name(
    tmp_path: Path,
) -> None:
    for host in ("0.0.0.0", "::", "10.1.2.3", "metaserver.example"):
        refused = _start("--host", host)
        assert refused.returncode == 2, (host, refused.stderr)
        assert "without credentials" in refused.stderr and "--insecure-open" in refused.stderr
    # the same with a credential, or asked by name, starts (it binds nothing it cannot: the
    # unroutable address fails later, at bind, not at this check)
    ran = _start("--host", "0.0.0.0", "--insecure-open")
    assert ran.returncode == -1, ran.stderr  # still serving when the 8 s ran out
    assert "INSECURE" in ran.stderr and "as admin" in ran.stderr
    ms = MetaserverProcess("memory", log_dir=tmp_path)  # loopback, open: a development machine
    try:
        assert httpx.get(f"{ms.url}/v1/instances", timeout=5).status_code == 200
        log = next(tmp_path.glob("metaserver-*.log")).read_text()
        assert "WARNING" in log and "INSECURE" in log
    finally:
        ms.stop()


def test_reads_need_a_credential_by_default(tmp_path: Path) -> None:
    token = "a-token-of-sixteen-chars"
    ms = MetaserverProcess("memory", "--token", token, log_dir=tmp_path)
    try:
        auth = {"authorization": f"Bearer {token}"}
        for path in ("/v1/instances", "/v1/bindings", "/v1/stats", "/v1/breakdown", "/v1/kv"):
            assert httpx.get(ms.url + path, timeout=5).status_code == 401, path
            assert httpx.get(ms.url + path, headers=auth, timeout=5).status_code == 200, path
        for path in ("/health", "/ready", "/metrics", "/ui/"):  # probes, scrapes, the page
            assert httpx.get(ms.url + path, timeout=5).status_code == 200, path
    finally:
        ms.stop()
    opened = MetaserverProcess("memory", "--token", token, "--open-reads", log_dir=tmp_path)
    try:
        assert httpx.get(opened.url + "/v1/instances", timeout=5).status_code == 200
    finally:
        opened.stop()
