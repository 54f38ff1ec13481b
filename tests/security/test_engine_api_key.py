"""Engines that answer only the proxy: vLLM's ``--api-key`` (``VLLM_API_KEY``) on every engine
and the same key in the proxy (``PD_PROXY_ENGINE_API_KEY``), which sends it on every leg and on
``/v1/models``. Before, the proxy had no way to send one, so engines ran without: anything that
reached an engine's HTTP port (a peer pod, a sidecar) could drive P directly with a binding of its
choosing (security_review H4). The engine stand-in checks the key as vLLM's middleware does."""

from __future__ import annotations

from pathlib import Path

import httpx

from tests.fakes.control import FakeVLLM
from tests.fakes.render import MODEL
from tests.support.services import MetaserverProcess, ProxyProcess

KEY = "engine-key-only-the-proxy-holds"


def test_engines_answer_only_the_proxy(tmp_path: Path) -> None:
    started: list[MetaserverProcess | FakeVLLM | ProxyProcess] = []
    try:
        ms = MetaserverProcess("memory", log_dir=tmp_path)
        started.append(ms)
        env = {"VLLM_API_KEY": KEY}
        p = FakeVLLM("prefill", metaserver=ms.url, log_dir=tmp_path, env=env)
        started.append(p)
        d = FakeVLLM("decode", metaserver=ms.url, log_dir=tmp_path, env=env)
        started.append(d)
        proxy = ProxyProcess(
            "--prefill", p.url, "--decode", d.url, "--metaserver", ms.url,
            "--flow", "decode-first", "--retries", "0", log_dir=tmp_path,
            env={"PD_PROXY_ENGINE_API_KEY": KEY},
        )  # fmt: skip
        started.append(proxy)
        body = {"model": MODEL, "prompt": "hello " * 20, "max_tokens": 4}
        for engine in (p, d):  # straight to an engine, without the key: refused
            assert httpx.post(f"{engine.url}/v1/completions", json=body).status_code == 401
            assert httpx.get(f"{engine.url}/health").status_code == 200  # probes stay open
        for _ in range(3):
            answer = httpx.post(f"{proxy.url}/v1/completions", json=body, timeout=20)
            assert answer.status_code == 200, answer.text
            assert answer.json()["choices"][0]["text"]
        models = httpx.get(f"{proxy.url}/v1/models", timeout=20)
        assert [m["id"] for m in models.json()["data"]] == [MODEL], models.text
        assert p.stats()["unauthorized"] == d.stats()["unauthorized"] == 1  # only ours
        seen = p.requests() + d.requests()
        assert {r["authorization"] for r in seen} == {f"Bearer {KEY}"}
        assert len(p.requests()) == len(d.requests()) == 3  # P's legs and D's, all keyed
    finally:
        for part in reversed(started):
            part.stop()
