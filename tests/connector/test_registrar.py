"""Registration and heartbeat against a real metaserver."""

from __future__ import annotations

import itertools
import logging
import time

import httpx
import pytest

from connector.scheduler.registrar import Registrar
from pdwire.client import MetaserverClient
from pdwire.models import InstanceRole, InstanceSpec, KVEndpoint
from tests.support.services import InThreadMetaserver

TOKEN = "t0ken"
AUTH = {"authorization": f"Bearer {TOKEN}"}


def _spec() -> InstanceSpec:
    return InstanceSpec(
        role=InstanceRole.DECODE,
        url="http://127.0.0.1:8001",
        kv_endpoint=KVEndpoint(host="127.0.0.1", port=5800),
        ttl_s=6.0,
    )


def test_registrar_registers_and_reports_a_heartbeat_that_came_after_expiry(
    metaserver: InThreadMetaserver, caplog: pytest.LogCaptureFixture
) -> None:
    beats = itertools.chain([0.0, 2.0, 30.0], itertools.count(31.0))  # 3rd beat 28 s late
    reg = Registrar(
        MetaserverClient(metaserver.url, token=TOKEN),
        "dec-9",
        _spec(),
        0.02,
        clock=lambda: next(beats),
    )
    with caplog.at_level(logging.WARNING, logger="pdgate.connector.registrar"):
        reg.start()
        assert reg.registered.wait(10)
        got = httpx.get(f"{metaserver.url}/v1/instances/dec-9", headers=AUTH).json()
        assert got["kv_endpoint"] == {"host": "127.0.0.1", "port": 5800}
        for _ in range(500):
            if reg.beats >= 4:
                break
            time.sleep(0.02)
        reg.close()
    assert reg.lapses == 1
    assert "landed 28.0s after the previous one" in caplog.text
    assert (
        httpx.get(f"{metaserver.url}/v1/instances/dec-9", headers=AUTH).status_code == 404
    )  # deregistered
