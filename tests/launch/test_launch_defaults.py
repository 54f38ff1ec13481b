"""pd-launch secure by default (issue 46): metaserver roles with fresh credentials per launch
(``--token`` single-token mode, ``--insecure-open`` an open metaserver on loopback only), a
fresh engine API key (engines' ``VLLM_API_KEY``, the proxy's ``PD_PROXY_ENGINE_API_KEY``, never
on a command line), and KV-event publishers bound to ``--host`` only."""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from connector.config import local_ip
from launch import cli
from launch.credentials import CREDENTIALS
from launch.options import LaunchOptions
from launch.plan import build_plan, kv_events_config
from tests.support.procs import free_port_block


def _options(tmp_path: Path, *argv: str) -> LaunchOptions:
    """What pd-launch runs with, its secrets in a fresh private directory under ``tmp_path``."""
    secrets = tmp_path / f"launch-{len(list(tmp_path.iterdir()))}"
    secrets.mkdir(mode=0o700)
    args = cli.build_parser().parse_args(["--model", "m", *argv])
    return cli.launch_options(args, None, secrets)


def test_roles_mode_is_the_default_with_fresh_credentials(tmp_path: Path) -> None:
    opts = _options(tmp_path)
    assert opts.credentials_dir and opts.token is None
    plan = build_plan(opts)
    assert "--credentials-file" in plan.children[0].argv
    assert (Path(opts.credentials_dir) / CREDENTIALS).stat().st_mode & 0o777 == 0o600
    assert all(c.env["PDGATE_METASERVER_TOKEN"] for c in plan.children if c.kind == "engine")
    assert _options(tmp_path, "--roles").credentials_dir  # still accepted: the default now


def test_token_selects_single_token_mode_and_insecure_open_runs_it_open(tmp_path: Path) -> None:
    single = _options(tmp_path, "--token", "tok-123")
    assert single.token == "tok-123" and not single.credentials_dir
    open_ = _options(tmp_path, "--insecure-open")
    assert open_.token is None and not open_.credentials_dir
    ms = build_plan(open_).children[0]
    assert "--credentials-file" not in ms.argv and "PD_METASERVER_TOKEN" not in ms.env
    with pytest.raises(SystemExit, match="loopback"):
        _options(tmp_path, "--insecure-open", "--host", "0.0.0.0")
    with pytest.raises(SystemExit):
        cli.build_parser().parse_args(["--model", "m", "--token", "t", "--insecure-open"])


def test_a_fresh_engine_api_key_reaches_engines_and_proxy_only_by_environment(
    tmp_path: Path,
) -> None:
    opts = _options(tmp_path)
    assert (
        len(opts.engine_api_key) >= 32 and opts.engine_api_key != _options(tmp_path).engine_api_key
    )
    plan = build_plan(opts)
    engines = [c for c in plan.children if c.kind == "engine"]
    proxy = plan.children[-1]
    assert engines and all(c.env["VLLM_API_KEY"] == opts.engine_api_key for c in engines)
    assert proxy.env["PD_PROXY_ENGINE_API_KEY"] == opts.engine_api_key
    for child in plan.children:
        assert opts.engine_api_key not in " ".join(child.argv)
    assert plan.children[0].env.get("VLLM_API_KEY") is None  # the metaserver has no use for it


def _listens(host: str, port: int) -> bool:
    try:
        with socket.create_connection((host, port), timeout=2):
            return True
    except OSError:
        return False


@pytest.fixture
def publisher() -> Iterator[tuple[int, object]]:
    """vLLM's own KV-event publisher, configured as pd-launch configures it on 127.0.0.1."""
    from vllm.distributed import kv_events as vllm_events

    port = free_port_block(2)  # the publisher and its replay socket (port + 1)
    cfg = json.loads(kv_events_config(port, "127.0.0.1"))
    pub = vllm_events.ZmqEventPublisher(
        0, endpoint=cfg["endpoint"], replay_endpoint=cfg["replay_endpoint"], topic="kv"
    )
    try:
        yield port, pub
    finally:
        pub.shutdown()


def test_kv_event_publishers_listen_on_the_launch_host_only(
    publisher: tuple[int, object],
) -> None:
    other = local_ip()
    if other.startswith("127."):
        pytest.skip("this machine has no address but loopback")
    port, _ = publisher
    deadline = time.monotonic() + 10
    while not _listens("127.0.0.1", port):  # the publisher binds on its own thread
        assert time.monotonic() < deadline, "the publisher never listened"
        time.sleep(0.05)
    assert _listens("127.0.0.1", port + 1)  # its replay socket
    assert not _listens(other, port) and not _listens(other, port + 1)


def test_kv_events_of_an_ipv6_or_named_host_are_refused_not_opened_wide() -> None:
    with pytest.raises(ValueError, match="IPv4"):
        kv_events_config(5700, "myhost.example")
    assert json.loads(kv_events_config(5700, "0.0.0.0"))["endpoint"] == "tcp://*:5700"


def test_the_demo_reads_the_metaserver_with_the_launch_credential(tmp_path: Path) -> None:
    from launch.demo import metaserver_auth

    roles = build_plan(_options(tmp_path))
    admin = (Path(roles.options.credentials_dir) / "admin.token").read_text().strip()
    assert metaserver_auth(roles) == {"authorization": f"Bearer {admin}"}
    single = build_plan(_options(tmp_path, "--token", "tok-123"))
    assert metaserver_auth(single) == {"authorization": "Bearer tok-123"}
    assert metaserver_auth(build_plan(_options(tmp_path, "--insecure-open"))) == {}
