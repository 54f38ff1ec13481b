"""What the proxy tells a client about its insides, on a real ``pd-proxy`` process with engine
stand-ins (security_review L3, N16).

Before: any API key listed the engines' internal URLs, ids and drains (``GET /v1/instances``);
a failed leg's 502/504 body named the engine's URL and quoted its answer; an engine's own 4xx
body went to the client byte for byte. Now ``/v1/instances`` needs the admin key, failures say
which leg failed and how, without addresses (those stay in the proxy's log and traces), and an
engine's 4xx is parsed as an OpenAI error and rebuilt; an engine refusing the proxy's own
credentials (401/403) is the proxy's fault, a 502, not the client's."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.fakes.control import FakeVLLM
from tests.fakes.render import MODEL
from tests.support.procs import until
from tests.support.services import ProxyProcess

API, ADMIN = "client-key-0123456789", "admin-key-0123456789"
BODY = {"model": MODEL, "prompt": "hello " * 10, "max_tokens": 4}


@pytest.fixture
def stack(tmp_path: Path) -> Iterator[tuple[ProxyProcess, FakeVLLM]]:
    d = FakeVLLM("decode", log_dir=tmp_path, env={"VLLM_API_KEY": "engine-key-0123456789"})
    try:
        proxy = ProxyProcess(
            "--decode", d.url, "--flow", "direct", "--retries", "0", "--health-interval", "0.2",
            log_dir=tmp_path,
            env={"PD_PROXY_API_KEYS": API, "PD_PROXY_ADMIN_KEYS": ADMIN,
                 "PD_PROXY_ENGINE_API_KEY": "engine-key-0123456789"},
        )  # fmt: skip
        try:
            yield proxy, d
        finally:
            proxy.stop()
    finally:
        d.stop()


def _as(key: str) -> dict[str, str]:
    return {"authorization": f"Bearer {key}"}


def test_the_instances_view_is_for_operators(stack: tuple[ProxyProcess, FakeVLLM]) -> None:
    proxy, d = stack
    for key in (None, API):
        r = httpx.get(f"{proxy.url}/v1/instances", headers=_as(key) if key else None)
        assert r.status_code in (401, 403) and d.url not in r.text, r.text
    seen = httpx.get(f"{proxy.url}/v1/instances", headers=_as(ADMIN))
    assert seen.status_code == 200 and d.url in seen.text


def test_a_failed_leg_names_no_address(stack: tuple[ProxyProcess, FakeVLLM]) -> None:
    proxy, d = stack
    d.configure(error_status=500)
    r = httpx.post(f"{proxy.url}/v1/completions", json=BODY, headers=_as(API), timeout=20)
    assert r.status_code == 502
    error = r.json()["error"]
    assert "decode" in error["message"]  # which leg, and how
    assert d.url not in r.text and "127.0.0.1" not in r.text and "injected" not in r.text
    log = next(Path(proxy.proc.log_path or "").parent.glob(f"proxy-{proxy.port}.log"))
    assert d.url in log.read_text()  # the operator still sees where


def test_an_engines_4xx_is_rebuilt_and_its_refusal_of_the_proxy_is_a_502(
    stack: tuple[ProxyProcess, FakeVLLM],
) -> None:
    proxy, d = stack
    d.configure(error_status=400)
    r = httpx.post(f"{proxy.url}/v1/completions", json=BODY, headers=_as(API), timeout=20)
    assert r.status_code == 400
    assert set(r.json()) == {"error"}
    assert set(r.json()["error"]) == {"message", "type", "param", "code"}
    assert r.json()["error"]["message"] == "injected error"  # the client's problem, said
    d.configure(error_status=0)
    d.stop()  # the same engine again without the proxy's key
    other = FakeVLLM("decode", port=d.port, log_dir=Path(d.proc.log_path or "/tmp").parent,
                     env={"VLLM_API_KEY": "another-key-0123456789"})  # fmt: skip
    try:
        until(lambda: httpx.get(f"{proxy.url}/health").status_code == 200, 10)  # probed again
        r = httpx.post(f"{proxy.url}/v1/completions", json=BODY, headers=_as(API), timeout=20)
        assert r.status_code == 502, r.text  # not the client's 401
        assert "Unauthorized" not in json.dumps(r.json())
    finally:
        other.stop()
