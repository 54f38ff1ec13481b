"""``floor_relay.py``'s lower bounds do the work they stand in for: the bare relay sends P the
prefill request and D P's ``kv_transfer_params``, and passes D's answer through whole, as the
proxy's prefill-first flow does; the echo servers answer every request."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.fakes import FakeVLLM
from tests.support.procs import Process, free_port, wait_http

FLOOR = Path(__file__).with_name("floor_relay.py")


@pytest.fixture(scope="module")
def pd(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[FakeVLLM, FakeVLLM]]:
    logs = tmp_path_factory.mktemp("floor")
    p = FakeVLLM("prefill", log_dir=logs)
    try:
        d = FakeVLLM("decode", log_dir=logs)
        try:
            yield p, d
        finally:
            d.stop()
    finally:
        p.stop()


def _start(*args: str) -> tuple[str, Process]:
    port = free_port()
    proc = Process([sys.executable, str(FLOOR), *args, "--port", str(port)])
    url = f"http://127.0.0.1:{port}"
    try:
        wait_http(url + "/health", proc=proc)
    except BaseException:
        proc.stop()
        raise
    return url, proc


@pytest.mark.parametrize("stream", [False, True])
def test_floor_relay_sends_p_then_d_with_ps_params(
    pd: tuple[FakeVLLM, FakeVLLM], stream: bool
) -> None:
    p, d = pd
    p.reset()
    d.reset()
    url, proc = _start("relay", p.url, d.url)
    try:
        body = {"model": "m", "prompt": "hello", "max_tokens": 16, "stream": stream}
        with httpx.Client(base_url=url, timeout=10) as client:
            for _ in range(2):  # the second one on the kept-alive connections
                r = client.post("/v1/completions", json=body)
                assert r.status_code == 200
                if stream:
                    assert r.text.rstrip().endswith("data: [DONE]")
                else:
                    assert r.json()["usage"]["completion_tokens"] == 16
    finally:
        proc.stop()
    to_p, to_d = p.requests(), d.requests()
    assert len(to_p) == len(to_d) == 2
    sent = to_p[0]["body"]
    assert sent["max_tokens"] == 1 and sent["stream"] is False
    assert sent["kv_transfer_params"] == {"do_remote_decode": True, "do_remote_prefill": False}
    got = to_d[0]["body"]
    assert got["stream"] is stream and got["max_tokens"] == 16
    assert got["kv_transfer_params"]["do_remote_prefill"] is True  # P's answer, handed on
    assert got["kv_transfer_params"]["remote_engine_id"] == p.instance_id


@pytest.mark.parametrize("kind", ["echo-lean", "echo-asgi"])
def test_floor_echo_answers_every_request(kind: str) -> None:
    url, proc = _start(kind)
    try:
        with httpx.Client(base_url=url, timeout=10) as client:
            for _ in range(3):
                r = client.post("/v1/completions", json={"prompt": "x"})
                assert r.status_code == 200
                assert r.json()["object"] == "text_completion"
    finally:
        proc.stop()


def test_floor_relay_without_upstreams_is_a_usage_error() -> None:
    import subprocess

    out = subprocess.run(
        [sys.executable, str(FLOOR), "relay", "--port", "1"], capture_output=True, text=True
    )
    assert out.returncode == 2
    assert "relay needs P's and D's base URLs" in out.stderr
