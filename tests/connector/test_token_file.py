"""The connector's metaserver token from a file (``metaserver_token_file``), picked up again
when the file is rotated mid-run; ``metaserver_token`` > the file > ``$PDGATE_METASERVER_TOKEN``.
``python -m connector.drain --token-file`` reads it the same way."""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from connector.config import TOKEN_ENV, load_settings
from connector.drain import main as drain_main
from connector.errors import ConfigError
from connector.scheduler import ConnectorScheduler
from pdwire.client import MetaserverClient
from pdwire.client.token import FileToken, token_of
from pdwire.models import InstanceRole, InstanceSpec
from tests.connector import harness as H
from tests.support.sealing import sealed
from tests.support.services import InThreadMetaserver, MetaserverProcess

TOKEN = "t0ken"  # the metaserver fixture's


def rotate(path: Path, token: str) -> None:
    aside = path.with_name(path.name + ".new")
    aside.write_text(token + "\n")
    os.replace(aside, path)


def test_precedence_token_then_file_then_environment(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "token"
    path.write_text("from-the-file\n")
    monkeypatch.setenv(TOKEN_ENV, "from-the-env")
    both = load_settings(sealed({"metaserver_token": "given", "metaserver_token_file": str(path)}))
    assert token_of(both.token) == "given"
    from_file = load_settings(sealed({"metaserver_token_file": str(path)}))
    assert isinstance(from_file.token, FileToken) and token_of(from_file.token) == "from-the-file"
    assert token_of(load_settings(sealed({})).token) == "from-the-env"
    with pytest.raises(ConfigError, match="metaserver_token_file"):
        load_settings(sealed({"metaserver_token_file": str(tmp_path / "missing")}))


def test_a_rotated_token_file_is_used_by_the_registration_mid_run(
    tiny_model: Path, metaserver: InThreadMetaserver, tmp_path: Path
) -> None:
    """The scheduler half starts with a token the metaserver refuses (an expired one), then
    the file is rotated: its next heartbeat registers it."""
    path = tmp_path / "token"
    path.write_text("expired-token-0123\n")
    extra = {
        "metaserver_url": metaserver.url,
        "metaserver_token_file": str(path),
        "instance_id": "decode-9",
        "side_channel_host": "127.0.0.1",
        "heartbeat_s": 0.2,
    }
    scheduler = ConnectorScheduler(H.vllm_config(tiny_model, "kv_consumer", extra),
                                   load_settings(sealed(extra)))  # fmt: skip
    try:
        time.sleep(0.5)
        assert not scheduler.registrar.registered.is_set()
        rotate(path, TOKEN)
        assert scheduler.registrar.registered.wait(10), "the rotated token was never used"
        with MetaserverClient(metaserver.url, token=TOKEN) as client:
            assert client.get_instance("decode-9").role is InstanceRole.DECODE
    finally:
        scheduler.shutdown()


def test_drain_reads_its_token_from_a_file(
    metaserver_factory: Callable[..., MetaserverProcess], tmp_path: Path
) -> None:
    ms = metaserver_factory("memory", "--token", TOKEN)
    with MetaserverClient(ms.url, token=TOKEN) as client:
        client.put_instance("decode-7", InstanceSpec(role=InstanceRole.DECODE, url="http://x:1"))
        path = tmp_path / "token"
        path.write_text(TOKEN + "\n")
        dead = "http://127.0.0.1:9"  # no engine: taken as idle
        args = ["--metaserver", ms.url, "--instance-id", "decode-7", "--engine", dead,
                "--settle", "0", "--poll", "0.05", "--token-file", str(path)]  # fmt: skip
        assert drain_main(args) == 0
        assert client.get_instance("decode-7").draining is True
