"""pd-metaserver's configuration layering (flags > env > YAML > defaults) and CLI errors."""

from __future__ import annotations

import json
import ssl
import subprocess
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest

from metaserver.cli import load_settings
from metaserver.store.redis import RedisStore
from pdservice.settings import redact_url
from tests.metaserver.conftest import binding_spec, decode_instance
from tests.support.certs import self_signed
from tests.support.procs import VENV_BIN, Process, free_port, wait_http
from tests.support.services import MetaserverProcess


def test_cli_settings_precedence(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = tmp_path / "ms.yaml"
    cfg.write_text("port: 9001\nbinding_ttl_s: 11\nretain_s: 22\nnamespace: fromyaml\n")
    monkeypatch.setenv("PD_METASERVER_BINDING_TTL_S", "33")
    monkeypatch.setenv("PD_METASERVER_NAMESPACE", "fromenv")
    s = load_settings(["--config", str(cfg), "--namespace", "fromflag"])
    assert s.port == 9001  # yaml over default
    assert s.retain_s == 22  # yaml
    assert s.binding_ttl_s == 33  # env over yaml
    assert s.namespace == "fromflag"  # flag over env
    assert s.instance_ttl_s == 30  # default
    monkeypatch.setenv("PD_METASERVER_CONFIG_FILE", str(cfg))
    assert load_settings([]).port == 9001


def test_cli_settings_redact_secrets(monkeypatch: pytest.MonkeyPatch) -> None:
    s = load_settings(["--token", "hunter2", "--store", "redis://user:pw@redis:6379/0"])
    text = repr(s)
    assert "hunter2" not in text and "pw@" not in text
    assert "redis://***@redis:6379/0" in text
    assert s.token is not None and s.token.get_secret_value() == "hunter2"


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--port", "99999"], "port"),
        (["--ttl", "-5"], "binding_ttl_s"),
        (["--config", "/nonexistent.yaml"], "does not exist"),
        (["--store", "mongodb://x"], "unknown store"),
        (["--log-level", "loud"], "log_level"),
        (["--tls-key", "key.pem"], "--tls-cert and --tls-key go together"),
    ],
)
def test_cli_rejects_bad_settings_with_clear_error(argv: list[str], message: str) -> None:
    proc = subprocess.run(
        [str(VENV_BIN / "pd-metaserver"), *argv], capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 2
    assert message in proc.stderr
    assert "Traceback" not in proc.stderr


def test_cli_logs_address_and_store(tmp_path: Path) -> None:
    port = free_port()
    log = tmp_path / "ms.log"
    proc = Process([str(VENV_BIN / "pd-metaserver"), "--port", str(port), "--token", "t"], log=log)
    try:
        wait_http(f"http://127.0.0.1:{port}/health", proc=proc)
        text = log.read_text()
        assert f"listening on http://127.0.0.1:{port}" in text
        assert "store: memory" in text and "access: single token" in text
    finally:
        proc.stop()


def test_cli_serves_openapi_docs(metaserver_factory: Callable[..., MetaserverProcess]) -> None:
    ms = metaserver_factory()
    assert httpx.get(ms.url + "/docs").status_code == 200
    assert "BindingSpec" in httpx.get(ms.url + "/openapi.json").text


def test_cli_stats_scan_limit_bounds_what_stats_counts(
    metaserver_factory: Callable[..., MetaserverProcess],
) -> None:
    ms = metaserver_factory("memory", "--stats-scan-limit", "2")
    inst = json.loads(decode_instance().model_dump_json())
    assert httpx.put(f"{ms.url}/v1/instances/decode-0", json=inst).status_code in (200, 201)
    for i in range(3):
        spec = json.loads(binding_spec(request_id=f"r{i}").model_dump_json())
        assert httpx.put(f"{ms.url}/v1/bindings/t{i}", json=spec).status_code == 201
    stats = httpx.get(f"{ms.url}/v1/stats").json()
    assert stats["bindings_scanned"] == 2 and stats["bindings_by_state"]["bound"] == 2


@pytest.mark.parametrize(
    "url",
    [
        "redis://user:pw-1@redis:6379/0",
        "redis+sentinel://:pw-1@s1:26379,s2:26379/mymaster/2?sentinel_password=pw-2",
        "redis://redis:6379/0?password=pw-1&socket_timeout=1",
        "redis://redis:6379/0?Sentinel_Password=pw-2&x_token=pw-3",
    ],
)
def test_store_urls_are_shown_without_any_secret(url: str) -> None:
    # before: the Sentinel password (a query parameter) was in /ready and the start-up log
    store = RedisStore(url, namespace="n", binding_ttl_s=60, retain_s=60)
    shown = [redact_url(url), store.description]
    for text in shown:
        assert "pw-" not in text, text
        assert "***" in text
    assert redact_url("redis://redis:6379/0?socket_timeout=1") == (
        "redis://redis:6379/0?socket_timeout=1"
    )


def test_cli_serves_https_with_tls_cert_and_key(tmp_path: Path) -> None:
    tls = self_signed(tmp_path)
    port = free_port()
    argv = [str(VENV_BIN / "pd-metaserver"), "--port", str(port)]
    proc = Process([*argv, "--tls-cert", str(tls.cert), "--tls-key", str(tls.key)],
                   log=tmp_path / "ms.log")  # fmt: skip
    trusting = ssl.create_default_context(cafile=str(tls.cert))
    try:
        wait_http(f"https://127.0.0.1:{port}/ready", proc=proc, verify=trusting)
        assert httpx.get(f"https://127.0.0.1:{port}/ready", verify=trusting).status_code == 200
        assert "listening on https://" in proc.tail()
    finally:
        proc.stop()
