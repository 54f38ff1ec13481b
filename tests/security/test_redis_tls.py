"""The metaserver's store over TLS: a real redis-server serving TLS only, reached with
``rediss://…?ssl_ca_certs=<CA file>`` (redis-py's connection option, from the URL). A server
whose certificate another CA signed is not trusted, and a plain connection gets nowhere."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from metaserver import MetaserverSettings, create_app, create_store
from metaserver.backend import create_backend
from metaserver.errors import StoreUnavailable
from tests.metaserver.conftest import binding_spec, decode_instance
from tests.support.certs import Cert, self_signed
from tests.support.procs import Process, free_port, wait_port


@pytest.fixture
def tls_redis(tmp_path: Path) -> Iterator[tuple[int, Cert]]:
    if shutil.which("redis-server") is None:
        pytest.fail("redis-server is not installed (make install does it)")
    (tmp_path / "ca").mkdir()
    cert = self_signed(tmp_path / "ca")  # its own CA, for 127.0.0.1
    port = free_port()
    argv = [
        "redis-server", "--port", "0", "--tls-port", str(port), "--tls-cert-file",
        str(cert.cert), "--tls-key-file", str(cert.key), "--tls-ca-cert-file", str(cert.cert),
        "--tls-auth-clients", "no", "--save", "", "--appendonly", "no",
    ]  # fmt: skip
    proc = Process(argv, log=tmp_path / "redis.log")
    try:
        wait_port(port)
        yield port, cert
    finally:
        proc.stop()


async def test_metaserver_store_over_tls_trusts_only_its_ca(
    tls_redis: tuple[int, Cert], tmp_path: Path
) -> None:
    port, cert = tls_redis
    url = f"rediss://127.0.0.1:{port}/0?ssl_ca_certs={cert.cert}"
    backend = create_backend(url, namespace="tls", binding_ttl_s=60, retain_s=60)
    await backend.start()
    try:
        app = create_app(MetaserverSettings(store=url), backend=backend)
        transport = httpx.ASGITransport(app)
        async with httpx.AsyncClient(transport=transport, base_url="http://ms") as c:
            assert (await c.get("/ready")).status_code == 200
            spec = decode_instance().model_dump(mode="json")
            assert (await c.put("/v1/instances/decode-0", json=spec)).status_code == 201
            r = await c.put("/v1/bindings/t1", content=binding_spec().model_dump_json())
            assert r.status_code == 201, r.text
            assert (await c.get("/v1/bindings/t1")).json()["state"] == "bound"
    finally:
        await backend.close()

    (tmp_path / "other").mkdir()
    other = self_signed(tmp_path / "other")  # a CA that did not sign the server's certificate
    for bad in (
        f"rediss://127.0.0.1:{port}/0?ssl_ca_certs={other.cert}",
        f"redis://127.0.0.1:{port}/0",  # no TLS at all
    ):
        store = create_store(bad, namespace="tls", binding_ttl_s=60, retain_s=60)
        try:
            with pytest.raises(StoreUnavailable):
                await store.start()
                await store.get_binding("t1")
        finally:
            await store.close()
