"""Engines that answer only the proxy: vLLM's ``--api-key`` (``VLLM_API_KEY``) on every engine
and the same key in the proxy (``PD_PROXY_ENGINE_API_KEY``), which sends it on every leg and on
``/v1/models``. Before, the proxy had no way to send one, so engines ran without: anything that
reached an engine's HTTP port (a peer pod, a sidecar) could drive P directly with a binding of its
choosing (security_review H4). The engine stand-in checks the key as vLLM's middleware does."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from proxy.cli import load_settings
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


@pytest.mark.parametrize("key", ["two words", "k\x00ey", "key\x7f", "ключ"])
def test_an_engine_key_cannot_carry_more_than_a_token(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], key: str
) -> None:
    """The key is written into every leg's header block as it is: a space or a control
    character would let one configured value add headers (or split the line), so such a key is
    refused at start, from the environment or from its file."""
    argv = [
        "--prefill",
        "http://p:8100",
        "--decode",
        "http://d:8200",
        "--metaserver",
        "http://m:8300",
    ]
    key_file = tmp_path / "key"
    key_file.write_text(key + "\n")
    with pytest.raises(SystemExit):  # the parser's usage error, naming the rule
        load_settings([*argv, "--engine-api-key-file", str(key_file)])
    assert "visible ASCII" in capsys.readouterr().err
    if "\x00" not in key:  # an environment cannot hold a NUL
        monkeypatch.setenv("PD_PROXY_ENGINE_API_KEY", key)
        with pytest.raises(SystemExit):
            load_settings(argv)
        assert "visible ASCII" in capsys.readouterr().err
    monkeypatch.setenv("PD_PROXY_ENGINE_API_KEY", "ok-Key_1.~")
    assert load_settings(argv).engine_authorization == "Bearer ok-Key_1.~"
