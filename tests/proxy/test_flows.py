"""The flows end to end: openai client → proxy → fake P/D (+ real metaserver)."""

from __future__ import annotations

import time
from typing import Any

import httpx
import pytest

from tests.proxy.conftest import Cluster, ProxyFactory, wait_until

PROMPT = "The quick brown fox jumps over the lazy dog. " * 8
MESSAGES: list[Any] = [{"role": "user", "content": PROMPT}]
EXPECTED_16 = "".join(f"tok{i} " for i in range(16))
INJECTED = {"do_remote_decode": True, "remote_host": "10.6.6.6", "transfer_id": "evil"}


def binding_state(cluster: Cluster, tid: str) -> str | None:
    r = httpx.get(f"{cluster.metaserver.url}/v1/bindings/{tid}")
    return str(r.json()["state"]) if r.status_code == 200 else None


def abandoned(cluster: Cluster, tid: str) -> tuple[str, str | None] | None:
    """The proxy's ``abandoned`` mark on the binding: (outcome, why); ``None`` without one."""
    r = httpx.get(f"{cluster.metaserver.url}/v1/bindings/{tid}")
    for m in r.json().get("marks", []) if r.status_code == 200 else []:
        if m["mark"] == "abandoned":
            return str(m["detail"]["outcome"]), m["detail"].get("message")
    return None


def binding_events(cluster: Cluster, tid: str) -> list[dict[str, Any]]:
    r = httpx.get(f"{cluster.metaserver.url}/v1/bindings/{tid}")
    return list(r.json()["events"])


def metric(text: str, line_start: str) -> float:
    for line in text.splitlines():
        if line.startswith(line_start):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


@pytest.mark.parametrize("http_client", ["native", "aiohttp"])
async def test_decode_first_stream_chat_hygiene_and_binding(
    cluster: Cluster, proxy_factory: ProxyFactory, http_client: str
) -> None:
    proxy = await proxy_factory(http_client=http_client)
    stream = await proxy.client().chat.completions.create(
        model="fake-model",
        messages=MESSAGES,
        max_tokens=16,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"kv_transfer_params": INJECTED, "min_tokens": 4, "min_completion_tokens": 4},
    )
    text, usage = "", None
    async for chunk in stream:
        if chunk.choices:
            text += chunk.choices[0].delta.content or ""
        if chunk.usage:
            usage = chunk.usage
    assert text == EXPECTED_16
    assert usage is not None and usage.completion_tokens == 16

    d_seen = cluster.decode[0].requests()[-1]
    kv_d = d_seen["body"]["kv_transfer_params"]
    assert set(kv_d) == {"do_remote_prefill", "transfer_id", "metaserver"}
    tid = kv_d["transfer_id"]
    assert kv_d["do_remote_prefill"] is True and tid != "evil"
    assert d_seen["body"]["stream"] is True and d_seen["body"]["min_tokens"] == 4

    p_seen = cluster.prefill[0].requests()[-1]
    body = p_seen["body"]
    assert body["max_tokens"] == 1 and body["stream"] is False
    assert "min_tokens" not in body and "stream_options" not in body
    assert "min_completion_tokens" not in body
    kv_p = body["kv_transfer_params"]
    assert kv_p["do_remote_decode"] is True and kv_p["transfer_id"] == tid
    assert kv_p["decode"]["decode_instance_id"] == cluster.decode[0].instance_id
    assert kv_p["decode"]["transfer_id"] == tid
    # P and D share a request id (their logs line up); it names D's answer, so it is not the
    # transfer id: a client never learns one
    assert p_seen["x_request_id"] == d_seen["x_request_id"] != tid

    stats = cluster.decode[0].stats()
    assert stats["kv_received"] == 1 and stats["kv_timeouts"] == 0
    await wait_until(lambda: binding_state(cluster, tid) == "done")


async def test_decode_first_nonstream_completions_n_logprobs(
    cluster: Cluster, proxy_factory: ProxyFactory
) -> None:
    proxy = await proxy_factory()
    out = await proxy.client().completions.create(
        model="fake-model", prompt=PROMPT, max_tokens=5, n=2, logprobs=1
    )
    assert [c.index for c in out.choices] == [0, 1]
    assert out.choices[0].text == "tok0 tok1 tok2 tok3 tok4 "
    assert out.choices[1].logprobs is not None
    assert out.choices[1].logprobs.token_logprobs == [-0.5] * 5
    p_body = cluster.prefill[0].requests()[-1]["body"]
    assert p_body["n"] == 1 and p_body["max_tokens"] == 1
    assert cluster.decode[0].requests()[-1]["body"]["n"] == 2


async def test_request_id_echoed_and_internal_id_shared(
    cluster: Cluster, proxy_factory: ProxyFactory
) -> None:
    proxy = await proxy_factory()
    async with proxy.http() as http:
        r = await http.post(
            "/v1/completions",
            json={"model": "fake-model", "prompt": PROMPT, "max_tokens": 2},
            headers={"x-request-id": "client-req-1"},
        )
    assert r.status_code == 200 and r.headers["x-request-id"] == "client-req-1"
    d_id = cluster.decode[0].requests()[-1]["x_request_id"]
    assert d_id == cluster.prefill[0].requests()[-1]["x_request_id"]
    assert d_id.startswith("pdr-")


@pytest.mark.parametrize("http_client", ["native", "aiohttp"])
async def test_concurrent_flow_sends_prefill_without_binding(
    cluster: Cluster, proxy_factory: ProxyFactory, http_client: str
) -> None:
    proxy = await proxy_factory(flow="concurrent", http_client=http_client)
    out = await proxy.client().completions.create(model="fake-model", prompt=PROMPT, max_tokens=16)
    assert out.choices[0].text == EXPECTED_16
    kv_p = cluster.prefill[0].requests()[-1]["body"]["kv_transfer_params"]
    # no binding: P fetches it, told which decode's it must be
    assert set(kv_p) == {"do_remote_decode", "transfer_id", "metaserver", "decode_instance"}
    assert kv_p["decode_instance"] == cluster.decode[0].instance_id
    assert cluster.decode[0].stats()["kv_received"] == 1


@pytest.mark.parametrize(("flow", "stream"), [("decode-first", True), ("concurrent", False)])
async def test_prefill_pushing_nothing_lets_decode_compute_at_once(
    cluster: Cluster, proxy_factory: ProxyFactory, flow: str, stream: bool
) -> None:
    why = "the registry does not vouch for dec-x at 10.0.0.9:5600"
    for p in cluster.prefill:
        p.configure(refuse_push=why)
    for d in cluster.decode:
        d.configure(kv_timeout_s=30)  # without the fallback the answer would take 30 s
    proxy = await proxy_factory(flow=flow)
    t0 = time.monotonic()
    out = await proxy.client().completions.create(
        model="fake-model", prompt=PROMPT, max_tokens=16, stream=stream
    )
    text = (
        "".join([c.choices[0].text async for c in out])  # type: ignore[union-attr]
        if stream
        else out.choices[0].text  # type: ignore[union-attr]
    )
    assert text == EXPECTED_16
    assert time.monotonic() - t0 < 10
    d = next(d for d in cluster.decode if d.requests())
    first, second = d.requests()
    tid = first["body"]["kv_transfer_params"]["transfer_id"]
    assert "kv_transfer_params" not in second["body"]  # D computes the prompt itself
    assert second["x_request_id"] == first["x_request_id"]
    await wait_until(lambda: d.stats()["cancelled"] == 1)  # the waiting leg was dropped
    assert d.stats()["kv_timeouts"] == 0
    await wait_until(lambda: abandoned(cluster, tid) is not None)
    outcome, message = abandoned(cluster, tid) or ("", None)
    assert outcome == "failed" and why in (message or ""), message
    async with proxy.http() as http:
        text = (await http.get("/metrics")).text
    assert metric(text, "pd_prefill_no_push_total") == 1


@pytest.mark.parametrize("http_client", ["native", "aiohttp"])
async def test_prefill_first_relays_kv_params_unchanged(
    cluster: Cluster, proxy_factory: ProxyFactory, http_client: str
) -> None:
    proxy = await proxy_factory(flow="prefill-first", http_client=http_client)
    stream = await proxy.client().completions.create(
        model="fake-model",
        prompt=PROMPT,
        max_tokens=16,
        stream=True,
        extra_body={"kv_transfer_params": INJECTED},
    )
    text = "".join([c.choices[0].text async for c in stream if c.choices])
    assert text == EXPECTED_16
    p_kv = cluster.prefill[0].requests()[-1]["body"]["kv_transfer_params"]
    assert p_kv == {
        "do_remote_decode": True,
        "do_remote_prefill": False,
        "remote_engine_id": None,
        "remote_block_ids": None,
        "remote_host": None,
        "remote_port": None,
    }
    d_kv = cluster.decode[0].requests()[-1]["body"]["kv_transfer_params"]
    assert d_kv == {
        "do_remote_prefill": True,
        "do_remote_decode": False,
        "remote_engine_id": cluster.prefill[0].instance_id,
        "remote_block_ids": [1, 2, 3],
        "remote_host": "127.0.0.1",
        "remote_port": cluster.prefill[0].port,
    }


async def test_prefill_first_missing_kv_params_retries_other_prefill(
    cluster: Cluster, proxy_factory: ProxyFactory
) -> None:
    cluster.prefill[0].configure(omit_kv_params=True)
    proxy = await proxy_factory(
        flow="prefill-first",
        prefill=[p.url for p in cluster.prefill],
        prefill_policy="round_robin",
    )
    for _ in range(2):
        out = await proxy.client().completions.create(
            model="fake-model", prompt=PROMPT, max_tokens=3
        )
        assert out.choices[0].text == "tok0 tok1 tok2 "
    assert "kv_transfer_params" in cluster.decode[0].requests()[-1]["body"]
    assert len(cluster.prefill[1].requests()) == 2


async def test_short_prompt_goes_direct_and_is_counted(
    cluster: Cluster, proxy_factory: ProxyFactory
) -> None:
    proxy = await proxy_factory(disagg_min_tokens=1000)
    out = await proxy.client().completions.create(model="fake-model", prompt="hi", max_tokens=2)
    assert out.choices[0].text == "tok0 tok1 "
    assert cluster.prefill[0].requests() == []
    assert "kv_transfer_params" not in cluster.decode[0].requests()[-1]["body"]
    async with proxy.http() as http:
        text = (await http.get("/metrics")).text
    assert metric(text, 'pd_decision_total{decision="short_prompt"}') == 1
    assert metric(text, 'pd_decision_total{decision="disaggregate"}') == 0
    d_url = cluster.decode[0].url
    d_ok = f'pd_instance_requests_total{{instance="{d_url}",outcome="ok",role="decode"}}'
    assert metric(text, d_ok) == 1


async def test_cached_prefix_goes_direct_with_prefix_policy(
    cluster: Cluster, proxy_factory: ProxyFactory
) -> None:
    proxy = await proxy_factory(decode_policy="prefix", cached_skip_ratio=0.9)
    long_prompt = "A shared system prompt that repeats. " * 40
    for _ in range(2):
        await proxy.client().completions.create(
            model="fake-model", prompt=long_prompt, max_tokens=1
        )
    assert len(cluster.prefill[0].requests()) == 1  # only the first one was disaggregated
    async with proxy.http() as http:
        text = (await http.get("/metrics")).text
    assert metric(text, 'pd_decision_total{decision="cached"}') == 1


async def test_prefill_cached_tokens_merged_into_usage(
    cluster: Cluster, proxy_factory: ProxyFactory
) -> None:
    cluster.prefill[0].configure(cached_tokens=7)
    cluster.decode[0].configure(cached_tokens=40)
    proxy = await proxy_factory()
    client = proxy.client()
    out = await client.completions.create(model="fake-model", prompt=PROMPT, max_tokens=2)
    assert out.usage is not None and out.usage.prompt_tokens_details is not None
    assert out.usage.prompt_tokens_details.cached_tokens == 7
    stream = await client.chat.completions.create(
        model="fake-model",
        messages=MESSAGES,
        max_tokens=2,
        stream=True,
        stream_options={"include_usage": True},
    )
    usages = [c.usage async for c in stream if c.usage]
    assert len(usages) == 1 and usages[0].prompt_tokens_details is not None
    assert usages[0].prompt_tokens_details.cached_tokens == 7


async def test_flow_header_selects_flow_per_request(
    cluster: Cluster, proxy_factory: ProxyFactory
) -> None:
    proxy = await proxy_factory(flow_header=True)
    client = proxy.client(default_headers={"x-pd-flow": "direct"})
    await client.completions.create(model="fake-model", prompt=PROMPT, max_tokens=1)
    assert cluster.prefill[0].requests() == []
    async with proxy.http() as http:
        r = await http.post(
            "/v1/completions",
            json={"model": "fake-model", "prompt": "x"},
            headers={"x-pd-flow": "sideways"},
        )
    assert r.status_code == 400 and "sideways" in r.json()["error"]["message"]


async def test_models_health_instances_endpoints(
    cluster: Cluster, proxy_factory: ProxyFactory
) -> None:
    proxy = await proxy_factory()
    models = await proxy.client().models.list()
    assert [m.id for m in models.data] == ["fake-model"]
    async with proxy.admin() as http:
        health = await http.get("/health")
        inst = (await http.get("/v1/instances")).json()
    assert health.status_code == 200
    assert health.json()["available"] == {"prefill": 1, "decode": 1}
    roles = sorted((i["role"], i["circuit"], i["healthy"]) for i in inst["instances"])
    assert roles == [("decode", "closed", True), ("prefill", "closed", True)]


async def test_stream_chat_n_and_logprobs_pass_through(
    cluster: Cluster, proxy_factory: ProxyFactory
) -> None:
    proxy = await proxy_factory()
    stream = await proxy.client().chat.completions.create(
        model="fake-model", messages=MESSAGES, max_tokens=3, n=2, logprobs=True, stream=True
    )
    texts = {0: "", 1: ""}
    logprobs = 0
    async for chunk in stream:
        for choice in chunk.choices:
            texts[choice.index] += choice.delta.content or ""
            if choice.logprobs and choice.logprobs.content:
                logprobs += len(choice.logprobs.content)
    assert texts == {0: "tok0 tok1 tok2 ", 1: "tok0 tok1 tok2 "}
    assert logprobs == 6
