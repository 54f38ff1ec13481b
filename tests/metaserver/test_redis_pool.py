"""``redis+sentinel://`` URLs: what they name, and clear errors for what they cannot."""

from __future__ import annotations

import subprocess

import pytest

from metaserver.store.redis_pool import SentinelURL, make_pool, parse_sentinel
from tests.support.procs import VENV_BIN


def test_redis_pool_parses_sentinels_service_db_and_passwords() -> None:
    url = "redis+sentinel://app:s3cr%40t@10.0.0.1:26379,[::1]:26380/pd%2Dgate/3?sentinel_password=q"
    assert parse_sentinel(url) == SentinelURL(
        sentinels=[("10.0.0.1", 26379), ("::1", 26380)],
        service="pd-gate",
        db=3,
        username="app",
        password="s3cr@t",
        sentinel_password="q",
    )
    assert parse_sentinel("rediss+sentinel://h:1/m").ssl is True
    tls = make_pool("rediss+sentinel://h:1/m?ssl_ca_certs=/etc/pdgate/ca.pem")
    assert tls.connection_kwargs["ssl_ca_certs"] == "/etc/pdgate/ca.pem"
    assert parse_sentinel("redis+sentinel://:pw@h:1/m").password == "pw"


@pytest.mark.parametrize(
    ("url", "why"),
    [
        ("redis+sentinel://h:1", "path is /<service>"),
        ("redis+sentinel://h:1/m/x", "database 'x'"),
        ("redis+sentinel:///m", "at least one host:port"),
        ("redis+sentinel://h/m", "'h' is not host:port"),
        ("redis+sentinel://h:1/m/0/extra", "path is /<service>"),
    ],
)
def test_redis_pool_refuses_malformed_sentinel_urls(url: str, why: str) -> None:
    with pytest.raises(ValueError, match=why):
        parse_sentinel(url)


def test_redis_pool_refuses_unknown_parameters() -> None:
    with pytest.raises(ValueError, match="unknown Sentinel URL parameter"):
        make_pool("redis+sentinel://h:1/m?sentinel_pasword=typo")


def test_cli_names_a_bad_store_url_in_one_line() -> None:
    out = subprocess.run(
        [str(VENV_BIN / "pd-metaserver"), "--store", "redis+sentinel://h:1"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode != 0
    assert "path is /<service>" in out.stderr and "Traceback" not in out.stderr
