"""Bad input, admission, auth, backend errors and errors inside streams."""

from __future__ import annotations

import asyncio

import openai
import pytest

from tests.proxy.conftest import Cluster, ProxyFactory, wait_until
from tests.proxy.test_flows import PROMPT, abandoned


async def test_malformed_json_is_400_without_backend_call(
    cluster: Cluster, proxy_factory: ProxyFactory
) -> None:
    proxy = await proxy_factory()
    async with proxy.http() as http:
        bad = await http.post("/v1/completions", content=b'{"prompt": "x",')
        not_object = await http.post("/v1/chat/completions", content=b"[1, 2]")
        no_messages = await http.post("/v1/chat/completions", json={"model": "m"})
        bad_stream = await http.post("/v1/completions", json={"prompt": "x", "stream": "yes"})
        nested = await http.post(
            "/v1/completions", content=b'{"prompt": ' + b"[" * 50_000 + b"]" * 50_000 + b"}"
        )
    for r in (bad, not_object, no_messages, bad_stream, nested):
        assert r.status_code == 400
        err = r.json()["error"]
        assert err["type"] == "invalid_request_error" and err["message"]
    assert cluster.decode[0].requests() == [] and cluster.prefill[0].requests() == []


async def test_body_over_cap_is_413(cluster: Cluster, proxy_factory: ProxyFactory) -> None:
    proxy = await proxy_factory(max_body_bytes=4096)
    async with proxy.http() as http:
        r = await http.post("/v1/completions", json={"model": "m", "prompt": "x" * 10_000})
    assert r.status_code == 413
    assert "4096" in r.json()["error"]["message"]
    assert cluster.decode[0].requests() == []


async def test_admission_limit_answers_429_with_retry_after(
    cluster: Cluster, proxy_factory: ProxyFactory
) -> None:
    cluster.decode[0].configure(first_token_delay_ms=800)
    proxy = await proxy_factory(max_inflight=1)
    client = proxy.client()
    first = asyncio.ensure_future(
        client.completions.create(model="fake-model", prompt=PROMPT, max_tokens=1)
    )
    await wait_until(lambda: proxy.runtime.admission.inflight == 1)
    async with proxy.http() as http:
        r = await http.post("/v1/completions", json={"model": "m", "prompt": PROMPT})
    assert r.status_code == 429 and r.headers["retry-after"] == "1"
    assert r.json()["error"]["type"] == "rate_limit_error"
    assert (await first).choices[0].text == "tok0 "
    assert proxy.runtime.admission.inflight == 0


async def test_api_keys_required_when_configured(
    cluster: Cluster, proxy_factory: ProxyFactory
) -> None:
    proxy = await proxy_factory(api_keys=["k1", "k2"])
    with pytest.raises(openai.AuthenticationError):
        await proxy.client(api_key="wrong").completions.create(model="m", prompt="x")
    with pytest.raises(openai.AuthenticationError):
        await proxy.client(api_key="wrong").models.list()
    out = await proxy.client(api_key="k2").completions.create(
        model="fake-model", prompt=PROMPT, max_tokens=1
    )
    assert out.choices[0].text == "tok0 "
    assert cluster.decode[0].requests()[-1]["authorization"] is None  # not forwarded


async def test_backend_4xx_passed_through_not_retried(
    cluster: Cluster, proxy_factory: ProxyFactory
) -> None:
    cluster.decode[0].configure(error_status=400)
    proxy = await proxy_factory(flow="direct", retries=3)
    with pytest.raises(openai.BadRequestError) as info:
        await proxy.client().completions.create(model="fake-model", prompt=PROMPT)
    assert "injected error" in str(info.value)
    assert len(cluster.decode[0].requests()) == 1


async def test_dropped_stream_ends_with_sse_error_event(
    cluster: Cluster, proxy_factory: ProxyFactory
) -> None:
    cluster.decode[0].configure(drop_after=3)
    proxy = await proxy_factory(flow="direct")
    stream = await proxy.client().completions.create(
        model="fake-model", prompt=PROMPT, max_tokens=16, stream=True
    )
    texts: list[str] = []
    with pytest.raises(openai.APIError, match="decode stream"):
        async for chunk in stream:
            texts.append(chunk.choices[0].text)
    assert texts == ["tok0 ", "tok1 ", "tok2 "]
    assert all(i.inflight == 0 for i in proxy.runtime.registry.instances())


async def test_backend_error_event_in_stream_reaches_client(
    cluster: Cluster, proxy_factory: ProxyFactory
) -> None:
    cluster.decode[0].configure(stream_error_after=2)
    proxy = await proxy_factory(flow="direct")
    stream = await proxy.client().chat.completions.create(
        model="fake-model", messages=[{"role": "user", "content": PROMPT}], stream=True
    )
    with pytest.raises(openai.APIError, match="injected stream error"):
        async for _ in stream:
            pass


async def test_prefill_failure_aborts_decode_and_marks_binding_failed(
    cluster: Cluster, proxy_factory: ProxyFactory
) -> None:
    cluster.prefill[0].configure(error_status=500)
    proxy = await proxy_factory(retries=1)
    with pytest.raises(openai.APIStatusError) as info:
        await proxy.client().completions.create(model="fake-model", prompt=PROMPT)
    assert info.value.status_code == 502
    d_seen = cluster.decode[0].requests()
    assert len(d_seen) == 2 and len(cluster.prefill[0].requests()) == 2  # one retry
    tids = [r["body"]["kv_transfer_params"]["transfer_id"] for r in d_seen]
    assert len(set(tids)) == 2  # a new transfer id per attempt
    await wait_until(lambda: cluster.decode[0].stats()["cancelled"] == 2)
    for tid in tids:
        await wait_until(lambda t=tid: abandoned(cluster, t) is not None)  # type: ignore[misc]
        assert (abandoned(cluster, tid) or ("",))[0] == "failed"
    assert all(i.inflight == 0 for i in proxy.runtime.registry.instances())
