"""The connector refuses to start with an unauthenticated side channel unless told so.

Without ``side_channel_secret_file`` anyone who reaches a D rank's side-channel port can send
a ``done`` signal for a transfer it knows (D decodes from blocks nobody wrote) or read D's KV
memory map; that used to be the silent default of a hand-started engine. Now it takes
``insecure_side_channel: true``, and every start says so at WARNING."""

from __future__ import annotations

import logging

import pytest

from connector.config import load_settings
from connector.errors import ConfigError
from connector.transport import InProcessTransport
from connector.worker import ConnectorWorker
from tests.support.sealing import key_file

INSECURE = "the P <-> D side channel is not authenticated"


def _start(extra: dict[str, object]) -> None:
    """A D worker rank's start, as vLLM makes it (the settings, then the worker)."""
    worker = ConnectorWorker(
        None,
        load_settings(extra),
        rank=0,
        tp_size=1,
        engine_id="d-engine",
        role="kv_consumer",
        transport=InProcessTransport(),
    )
    worker.shutdown()


def test_without_a_secret_file_the_connector_refuses_to_start_naming_both_keys() -> None:
    with pytest.raises(ConfigError) as refused:
        load_settings({"metaserver_url": "http://ms:8300"})
    assert "side_channel_secret_file" in str(refused.value)
    assert "insecure_side_channel" in str(refused.value)
    with pytest.raises(ConfigError, match="side_channel_secret_file"):
        load_settings({"insecure_side_channel": False})


def test_the_insecure_mode_is_asked_for_and_announced_at_every_start(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.WARNING, logger="pdgate")
    for _ in range(2):
        _start({"insecure_side_channel": True})
    warnings = [r for r in caplog.records if INSECURE in r.getMessage()]
    assert len(warnings) == 2 and all(r.levelno == logging.WARNING for r in warnings)


def test_a_sealed_side_channel_starts_without_the_warning(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="pdgate")
    _start({"side_channel_secret_file": key_file()})
    # a key file wins over the insecure flag: the channel is sealed, nothing to warn about
    _start({"side_channel_secret_file": key_file(), "insecure_side_channel": True})
    assert not [r for r in caplog.records if INSECURE in r.getMessage()]
