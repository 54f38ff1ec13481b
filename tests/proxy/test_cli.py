"""``pd-proxy``: flags > env > YAML > defaults, clear errors, and a real process serving."""

from __future__ import annotations

import socket
import ssl
import sys
import time
from pathlib import Path

import httpx
import pytest

from proxy.cli import build_parser, load_settings
from proxy.config import Flow
from tests.proxy.conftest import Cluster
from tests.proxy.test_flows import PROMPT
from tests.support.certs import self_signed
from tests.support.procs import Process, free_port, wait_http

CLIENT_IDLE_EXPIRY_S = 5.0  # httpx's default keepalive_expiry, the openai client's too


def test_flags_beat_env_beat_yaml(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = tmp_path / "proxy.yaml"
    cfg.write_text(
        "decode: [http://yaml-d:1]\nprefill: [http://yaml-p:1]\nport: 9001\n"
        "flow: prefill-first\nretries: 5\n"
    )
    monkeypatch.setenv("PD_PROXY_PORT", "9002")
    monkeypatch.setenv("PD_PROXY_API_KEYS", "k1, k2")
    s = load_settings(["--config", str(cfg), "--retries", "1", "--decode", "http://flag-d:2"])
    assert s.port == 9002 and s.retries == 1 and s.flow == Flow.PREFILL_FIRST
    assert s.decode == ["http://flag-d:2"] and s.prefill == ["http://yaml-p:1"]
    assert [k.get_secret_value() for k in s.api_keys] == ["k1", "k2"]
    assert "k1" not in repr(s)


def test_settings_errors_are_clear(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        load_settings(["--flow", "direct"])
    assert "at least one --decode URL" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        load_settings(["--decode", "http://d", "--prefill", "http://p"])  # decode-first
    assert "needs --metaserver" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        load_settings(["--decode", "ftp://d", "--flow", "direct"])
    assert "not an http(s) URL" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        load_settings(["--decode", "http://d", "--flow", "direct", "--decode-policy", "best"])
    assert "invalid choice: 'best'" in capsys.readouterr().err


def test_help_explains_the_flows() -> None:
    text = build_parser().format_help()
    for word in ("decode-first", "concurrent", "prefill-first", "direct", "--prefill-dns"):
        assert word in text


def test_pd_proxy_process_serves_and_stops(cluster: Cluster, tmp_path: Path) -> None:
    port = free_port()
    argv = [sys.executable, "-m", "proxy.cli", "--port", str(port), "--log-level", "warning"]
    argv += ["--prefill", cluster.prefill[0].url, "--decode", cluster.decode[0].url]
    argv += ["--metaserver", cluster.metaserver.url]
    proc = Process(argv, log=tmp_path / "proxy.log")
    try:
        wait_http(f"http://127.0.0.1:{port}/health", proc=proc)
        r = httpx.post(
            f"http://127.0.0.1:{port}/v1/completions",
            json={"model": "fake-model", "prompt": PROMPT, "max_tokens": 3},
            timeout=10,
        )
        assert r.status_code == 200
        assert r.json()["choices"][0]["text"] == "tok0 tok1 tok2 "
        metrics = httpx.get(f"http://127.0.0.1:{port}/metrics").text
        assert "pd_prefill_seconds_count 1.0" in metrics
        assert "pd_binding_wait_seconds_count 1.0" in metrics
    finally:
        proc.stop()
    assert not proc.alive()


def _get_health(sock: socket.socket) -> bytes:
    """One ``GET /health`` on ``sock``, its whole response read (status line to the last body
    byte), or what came before the proxy closed the connection."""
    sock.sendall(b"GET /health HTTP/1.1\r\nHost: proxy\r\n\r\n")
    reply = b""
    while b"\r\n\r\n" not in reply:
        chunk = sock.recv(4096)
        if not chunk:
            return reply  # closed by the proxy
        reply += chunk
    head, _, body = reply.partition(b"\r\n\r\n")
    length = next(
        int(line.split(b":", 1)[1])
        for line in head.lower().split(b"\r\n")
        if line.startswith(b"content-length:")
    )
    while len(body) < length:
        chunk = sock.recv(4096)
        if not chunk:
            break
        body += chunk
    return head + b"\r\n\r\n" + body


def test_pd_proxy_keeps_an_idle_client_connection_past_the_clients_own_expiry(
    cluster: Cluster, tmp_path: Path
) -> None:
    """httpx (and so the openai client) reuses a connection idle up to 5 s. A proxy closing
    idle connections at 5 s too (uvicorn's default) closes some just as a client sends on them,
    and that client gets a connection error for a request nobody refused (2 of 300 streams in a
    CI run of the chaos suite)."""
    port = free_port()
    argv = [sys.executable, "-m", "proxy.cli", "--port", str(port), "--log-level", "warning"]
    argv += ["--decode", cluster.decode[0].url, "--flow", "direct"]
    proc = Process(argv, log=tmp_path / "proxy.log")
    try:
        wait_http(f"http://127.0.0.1:{port}/health", proc=proc)
        with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
            assert _get_health(sock).startswith(b"HTTP/1.1 200")
            time.sleep(CLIENT_IDLE_EXPIRY_S + 1)
            assert _get_health(sock).startswith(b"HTTP/1.1 200")
    finally:
        proc.stop()


def test_pd_proxy_serves_https_with_tls_cert_and_key(cluster: Cluster, tmp_path: Path) -> None:
    tls = self_signed(tmp_path)
    port = free_port()
    argv = [sys.executable, "-m", "proxy.cli", "--port", str(port), "--log-level", "warning"]
    argv += ["--decode", cluster.decode[0].url, "--flow", "direct"]
    argv += ["--tls-cert", str(tls.cert), "--tls-key", str(tls.key)]
    trusting = ssl.create_default_context(cafile=str(tls.cert))
    proc = Process(argv, log=tmp_path / "proxy.log")
    try:
        wait_http(f"https://127.0.0.1:{port}/health", proc=proc, verify=trusting)
        assert httpx.get(f"https://127.0.0.1:{port}/health", verify=trusting).status_code == 200
        with pytest.raises(httpx.HTTPError):  # plain HTTP is not served on that port
            httpx.get(f"http://127.0.0.1:{port}/health", timeout=5)
    finally:
        proc.stop()


def test_tls_files_go_together_and_must_load(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    tls = self_signed(tmp_path)
    with pytest.raises(SystemExit):
        load_settings(["--decode", "http://d", "--flow", "direct", "--tls-cert", str(tls.cert)])
    assert "--tls-cert and --tls-key go together" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        load_settings(
            ["--decode", "http://d", "--flow", "direct", "--tls-cert", str(tls.key),
             "--tls-key", str(tls.key)]
        )  # fmt: skip
    assert "cannot serve TLS with" in capsys.readouterr().err
