"""What an engine credential may register, tried on real ``pd-metaserver`` and ``pd-proxy``
processes in roles mode (the chart's default), with the proxy discovering instances from the
metaserver (the README's multi-host example).

- **SSRF, answer reflected**: a decode credential registered ``http://internal/admin?ignore=``;
  the proxy's probes and ``GET /v1/models`` went to ``/internal/admin?ignore=/v1/models`` and
  handed that body to any API client. Now a URL is ``scheme://host:port`` and nothing else, and
  ``/v1/models`` answers only what parses as a model list, rebuilt.
- **Cross-pool URL collision**: a prefill credential registered its own id at a decoder's URL
  and drained it; every proxy then treated the decoder as drained (``/health`` 503, every
  request 503). Now no two live instances share a URL or a KV endpoint.
- **Unbounded registrations**: one pool token registered any number of ids with one-day TTLs.
  Now each credential has a cap, and ``ttl_s`` one too.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.fakes.control import FakeVLLM
from tests.fakes.render import MODEL
from tests.metaserver.conftest import TOKENS, write_credentials
from tests.security.internal import SECRET, InternalService
from tests.support.procs import until
from tests.support.services import MetaserverProcess, ProxyProcess


def _auth(name: str) -> dict[str, str]:
    return {"authorization": f"Bearer {TOKENS[name]}"}


class Stack:
    def __init__(self, ms: MetaserverProcess, proxy: ProxyProcess, d: FakeVLLM) -> None:
        self.ms, self.proxy, self.d = ms, proxy, d

    def register(self, who: str, instance_id: str, **spec: object) -> httpx.Response:
        """PUT an instance as ``who``: a decode at 10.0.0.7 unless ``spec`` says otherwise
        (sent as given: the client does not check what the metaserver must)."""
        body = {"role": "decode", "url": "http://10.0.0.7:8200"} | spec
        if body["role"] == "decode":
            body.setdefault("kv_endpoint", {"host": "10.0.0.7", "port": 5600})
        return httpx.put(
            f"{self.ms.url}/v1/instances/{instance_id}", json=body, headers=_auth(who), timeout=10
        )


@pytest.fixture
def stack(tmp_path: Path) -> Iterator[Stack]:
    started: list[MetaserverProcess | ProxyProcess | FakeVLLM] = []
    try:
        ms = MetaserverProcess(
            "memory", "--credentials-file", str(write_credentials(tmp_path)), log_dir=tmp_path
        )
        started.append(ms)
        d = FakeVLLM("decode", log_dir=tmp_path)
        started.append(d)
        proxy = ProxyProcess(
            "--discovery", "metaserver", "--metaserver", ms.url, "--flow", "direct",
            "--discovery-interval", "0.2", "--health-interval", "0.2", log_dir=tmp_path,
            env={"PD_PROXY_METASERVER_TOKEN": TOKENS["proxy"]},
        )  # fmt: skip
        started.append(proxy)
        s = Stack(ms, proxy, d)
        # the operator registers the real decoder (its own credential would do the same)
        got = s.register(
            "admin", "decode-1", url=d.url, kv_endpoint={"host": "127.0.0.1", "port": 5600}
        )
        assert got.status_code == 201, got.text
        yield s
    finally:
        for part in reversed(started):
            part.stop()


def _health(proxy: ProxyProcess) -> int:
    return httpx.get(f"{proxy.url}/health", timeout=5).status_code


def _available_decoders(proxy: ProxyProcess) -> int:
    return int(httpx.get(f"{proxy.url}/health", timeout=5).json()["available"]["decode"])


def _models(proxy: ProxyProcess) -> httpx.Response:
    return httpx.get(f"{proxy.url}/v1/models", timeout=20)


def test_a_decode_credential_cannot_aim_the_proxy_at_an_internal_service(stack: Stack) -> None:
    internal = InternalService()
    try:
        until(lambda: _health(stack.proxy) == 200, 10)
        aimed = f"{internal.origin}/internal/admin/credentials?ignore="
        got = stack.register("decode-0", "decode-0", url=aimed)
        assert got.status_code == 422, got.text  # a URL is scheme://host:port, nothing else
        for bad in (
            f"{internal.origin}/",
            "http://user:pw@127.0.0.1:1",
            "http://[::1:2",
            "http://127.0.0.1:8000#frag",
            "http://127.0.0.1",
            "ftp://127.0.0.1:21",
        ):
            assert stack.register("decode-0", "decode-0", url=bad).status_code == 422, bad
        # a bare origin is a URL like any other: the service it names gets the proxy's probes,
        # but its body is not a model list and never reaches a client
        assert stack.register("decode-0", "decode-0", url=internal.origin).status_code == 201
        until(lambda: _available_decoders(stack.proxy) == 2, 10)
        for _ in range(3):
            answer = _models(stack.proxy)
            assert SECRET not in answer.text
            assert answer.status_code == 200, answer.text
            assert answer.json()["object"] == "list"
            assert [m["id"] for m in answer.json()["data"]] == [MODEL]
        gone = httpx.delete(f"{stack.ms.url}/v1/instances/decode-1", headers=_auth("admin"))
        assert gone.status_code == 204
        until(lambda: _available_decoders(stack.proxy) == 1, 10)
        answer = _models(stack.proxy)
        assert answer.status_code == 503, answer.text
        assert SECRET not in answer.text
        assert "/v1/models" in internal.paths  # it was asked, and its answer went nowhere
        # nor does its answer to a completion (a whole answer is read as one before it goes)
        body = {"model": MODEL, "prompt": "hello", "max_tokens": 4}
        for stream in (False, True):
            got = httpx.post(f"{stack.proxy.url}/v1/completions", json=body | {"stream": stream},
                             timeout=20)  # fmt: skip
            assert SECRET not in got.text, got.text
        assert "/v1/completions" in internal.paths
    finally:
        internal.stop()


def test_a_prefill_credential_cannot_take_a_decoders_url(stack: Stack) -> None:
    until(lambda: _health(stack.proxy) == 200, 10)
    taken = stack.register("prefill-pool", "prefill-zzz", role="prefill", url=stack.d.url)
    assert taken.status_code == 409, taken.text
    drained = httpx.put(
        f"{stack.ms.url}/v1/instances/prefill-zzz/drain", headers=_auth("prefill-pool"), timeout=5
    )
    assert drained.status_code == 404
    # nor a decoder's KV endpoint, whatever the URL
    stolen_kv = stack.register("decode-0", "decode-0", url="http://127.0.0.1:9",
                               kv_endpoint={"host": "127.0.0.1", "port": 5600})  # fmt: skip
    assert stolen_kv.status_code == 409, stolen_kv.text
    # the decoder is untouched: still selectable, and its own heartbeat still goes through
    until(lambda: _health(stack.proxy) == 200, 5)
    again = stack.register("admin", "decode-1", url=stack.d.url,
                           kv_endpoint={"host": "127.0.0.1", "port": 5600})  # fmt: skip
    assert again.status_code == 200, again.text
    listed = httpx.get(f"{stack.ms.url}/v1/instances", headers=_auth("reader"), timeout=5).json()[
        "instances"
    ]
    assert [(i["instance_id"], i["draining"]) for i in listed] == [("decode-1", False)]
    answer = httpx.post(
        f"{stack.proxy.url}/v1/completions",
        json={"model": MODEL, "prompt": "hello", "max_tokens": 4}, timeout=20,
    )  # fmt: skip
    assert answer.status_code == 200, answer.text
    assert answer.json()["choices"][0]["text"]


def test_a_pool_credential_registers_a_bounded_number_of_instances(stack: Stack) -> None:
    codes = [
        stack.register("prefill-pool", f"prefill-{i}", role="prefill",
                       url=f"http://10.1.{i // 250}.{i % 250 + 1}:8000").status_code
        for i in range(70)
    ]  # fmt: skip
    assert codes[:64] == [201] * 64
    assert set(codes[64:]) == {403}
    # its registered instances still heartbeat
    again = stack.register("prefill-pool", "prefill-0", role="prefill", url="http://10.1.0.1:8000")
    assert again.status_code == 200, again.text
    # and a TTL above the cap is refused, one within it accepted
    long = stack.register("decode-0", "decode-0", url="http://10.2.0.1:8000", ttl_s=86_400)
    assert long.status_code == 422, long.text
    assert "300" in long.text
    short = stack.register("decode-0", "decode-0", url="http://10.2.0.1:8000", ttl_s=300)
    assert short.status_code == 201, short.text
