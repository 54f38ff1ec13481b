"""Retries, timeouts, circuit breaker, health probes, client disconnects."""

from __future__ import annotations

import asyncio
import os
import signal

import httpx
import openai
import pytest

from proxy.flows.bindings import ANSWER_MARGIN_S
from tests.proxy.conftest import Cluster, ProxyFactory, wait_until
from tests.proxy.test_flows import EXPECTED_16, PROMPT, abandoned
from tests.support.procs import free_port


async def test_retry_reselects_decode_after_5xx(
    cluster: Cluster, proxy_factory: ProxyFactory
) -> None:
    cluster.decode[0].configure(error_status=503)
    proxy = await proxy_factory(
        decode=[d.url for d in cluster.decode], decode_policy="round_robin", retries=2
    )
    for _ in range(4):
        out = await proxy.client().completions.create(
            model="fake-model", prompt=PROMPT, max_tokens=2
        )
        assert out.choices[0].text == "tok0 tok1 "
    assert len(cluster.decode[1].requests()) == 4
    async with proxy.http() as http:
        metrics = (await http.get("/metrics")).text
    assert 'pd_retries_total{reason="upstream_error"}' in metrics


async def test_circuit_opens_after_consecutive_failures(
    cluster: Cluster, proxy_factory: ProxyFactory
) -> None:
    cluster.decode[0].configure(error_status=500)
    proxy = await proxy_factory(
        flow="direct",
        decode=[d.url for d in cluster.decode],
        decode_policy="round_robin",
        retries=0,
        circuit_failures=2,
        circuit_open_s=60,
    )
    client = proxy.client()
    results = []
    for _ in range(8):
        try:
            await client.completions.create(model="fake-model", prompt=PROMPT, max_tokens=1)
            results.append("ok")
        except openai.APIStatusError as exc:
            results.append(str(exc.status_code))
    assert results.count("502") == 2  # then the circuit is open and D0 gets nothing
    assert len(cluster.decode[0].requests()) == 2
    async with proxy.admin() as http:
        listed = (await http.get("/v1/instances")).json()["instances"]
    state = {i["url"]: i["circuit"] for i in listed}
    assert state[cluster.decode[0].url] == "open" and state[cluster.decode[1].url] == "closed"


async def test_failed_health_probes_eject_instance(
    cluster: Cluster, proxy_factory: ProxyFactory
) -> None:
    proxy = await proxy_factory(decode=[d.url for d in cluster.decode])
    cluster.decode[0].configure(health_status=500)
    d0 = next(i for i in proxy.runtime.registry.instances() if i.url == cluster.decode[0].url)
    await wait_until(lambda: not d0.healthy)
    for _ in range(3):
        await proxy.client().completions.create(model="fake-model", prompt=PROMPT, max_tokens=1)
    assert cluster.decode[0].requests() == []
    cluster.decode[1].configure(health_status=500)
    d1 = next(i for i in proxy.runtime.registry.instances() if i.url == cluster.decode[1].url)
    await wait_until(lambda: not d1.healthy)
    async with proxy.http() as http:
        health = await http.get("/health")
        r = await http.post("/v1/completions", json={"model": "m", "prompt": PROMPT})
    assert health.status_code == 503 and health.json()["available"]["decode"] == 0
    assert r.status_code == 503 and r.headers["retry-after"] == "1"
    cluster.decode[0].configure(health_status=200)
    await wait_until(lambda: d0.healthy)


async def test_only_slow_health_probes_still_route_in_panic_mode(
    cluster: Cluster, proxy_factory: ProxyFactory
) -> None:
    """Every decode instance out of selection only because its /health answers too late (an
    engine saturated by a prefill): requests still go to them instead of a certain 503."""
    proxy = await proxy_factory()
    cluster.decode[0].configure(health_delay_ms=3000)  # the probe gives up after 2 s
    d0 = next(i for i in proxy.runtime.registry.instances() if i.url == cluster.decode[0].url)
    await wait_until(lambda: not d0.healthy, within=15)
    assert d0.slow
    r = await proxy.client().completions.create(model="fake-model", prompt=PROMPT, max_tokens=2)
    assert r.choices[0].text == "tok0 tok1 "
    async with proxy.http() as http:
        text = (await http.get("/metrics")).text
    assert 'pd_decision_total{decision="panic_decode"} 1.0' in text


async def test_first_token_timeout_is_504(cluster: Cluster, proxy_factory: ProxyFactory) -> None:
    cluster.decode[0].configure(hang=True)
    proxy = await proxy_factory(flow="direct", first_token_timeout_s=0.3, retries=0)
    with pytest.raises(openai.APIStatusError) as info:
        await proxy.client().completions.create(model="fake-model", prompt=PROMPT, stream=True)
    assert info.value.status_code == 504
    await wait_until(lambda: cluster.decode[0].stats()["cancelled"] == 1)


async def test_idle_timeout_mid_stream_ends_with_error_event(
    cluster: Cluster, proxy_factory: ProxyFactory
) -> None:
    cluster.decode[0].configure(token_delay_ms=1500)
    proxy = await proxy_factory(flow="direct", idle_timeout_s=0.3)
    stream = await proxy.client().completions.create(
        model="fake-model", prompt=PROMPT, max_tokens=4, stream=True
    )
    seen = []
    with pytest.raises(openai.APIError, match="decode stream broke"):
        async for chunk in stream:
            seen.append(chunk.choices[0].text)
    assert seen == ["tok0 "]
    await wait_until(lambda: cluster.decode[0].stats()["cancelled"] == 1)


async def test_binding_never_written_times_out_and_aborts_decode(
    cluster: Cluster, proxy_factory: ProxyFactory
) -> None:
    cluster.decode[0].configure(write_binding=False)
    proxy = await proxy_factory(binding_wait_s=0.3, retries=0)
    with pytest.raises(openai.APIStatusError) as info:
        await proxy.client().completions.create(model="fake-model", prompt=PROMPT)
    assert info.value.status_code == 504
    assert "binding" in str(info.value)
    assert cluster.prefill[0].requests() == []
    await wait_until(lambda: cluster.decode[0].stats()["cancelled"] == 1)


async def test_frozen_metaserver_lets_decode_compute_the_prompt(
    cluster: Cluster, proxy_factory: ProxyFactory
) -> None:
    """A metaserver that stops answering (SIGSTOP: a stalled host or process) holds no request
    for the outage: the binding read gives up ``ANSWER_MARGIN_S`` after its wait, and D gets
    the plain request. The metaserver stays frozen until the answer is in."""
    proxy = await proxy_factory(binding_wait_s=1.0, retries=0)
    metrics = proxy.http()
    pid = cluster.metaserver.proc.pid
    os.kill(pid, signal.SIGSTOP)
    try:
        # without the fallback this waits for the frozen metaserver: the client times out
        r = await proxy.client(timeout=1.0 + ANSWER_MARGIN_S + 10).completions.create(
            model="fake-model", prompt=PROMPT
        )
        assert r.choices[0].text == EXPECTED_16
        text = (await metrics.get("/metrics")).text
    finally:
        os.kill(pid, signal.SIGCONT)
    assert 'pd_decode_without_prefill_total{reason="binding_unreadable"} 1.0' in text
    assert "pd_prefill_no_push_total 0.0" in text
    first, second = cluster.decode[0].requests()
    assert first["body"]["kv_transfer_params"]["do_remote_prefill"] is True
    assert "kv_transfer_params" not in second["body"]  # the plain request: D computes
    assert cluster.prefill[0].requests() == []


@pytest.mark.parametrize("server", ["pd-proxy", "plain-uvicorn"])
async def test_client_disconnect_cancels_both_legs_and_aborts_binding(
    cluster: Cluster, proxy_factory: ProxyFactory, server: str
) -> None:
    """Noticed by proxy.server's connection_lost hook, or by the receive() watcher task when
    the app runs under uvicorn's stock protocol."""
    cluster.prefill[0].configure(prefill_delay_ms=10_000)
    extra = {"uvicorn_http": "httptools"} if server == "plain-uvicorn" else {}
    proxy = await proxy_factory(**extra)
    body = {"model": "fake-model", "prompt": PROMPT, "max_tokens": 4, "stream": True}

    async def go() -> None:
        async with httpx.AsyncClient(timeout=30) as http:
            await http.post(proxy.url + "/v1/completions", json=body)

    task = asyncio.ensure_future(go())
    await wait_until(lambda: len(cluster.prefill[0].requests()) == 1)
    tid = cluster.decode[0].requests()[-1]["body"]["kv_transfer_params"]["transfer_id"]
    task.cancel()
    await wait_until(lambda: cluster.prefill[0].stats()["cancelled"] == 1)
    await wait_until(lambda: cluster.decode[0].stats()["cancelled"] == 1)
    await wait_until(lambda: abandoned(cluster, tid) is not None)
    assert (abandoned(cluster, tid) or ("",))[0] == "aborted"
    assert all(i.inflight == 0 and i.tokens == 0 for i in proxy.runtime.registry.instances())
    assert proxy.runtime.admission.inflight == 0


async def test_client_disconnect_mid_stream_releases_load(
    cluster: Cluster, proxy_factory: ProxyFactory
) -> None:
    cluster.decode[0].configure(token_delay_ms=200)
    proxy = await proxy_factory()
    d0 = next(i for i in proxy.runtime.registry.instances() if i.url == cluster.decode[0].url)
    body = {"model": "fake-model", "prompt": PROMPT, "max_tokens": 50, "stream": True}
    async with httpx.AsyncClient(timeout=30) as http:
        async with http.stream("POST", proxy.url + "/v1/completions", json=body) as r:
            async for _ in r.aiter_bytes():
                break
            assert d0.inflight == 1
    await wait_until(lambda: cluster.decode[0].stats()["cancelled"] == 1)
    await wait_until(lambda: d0.inflight == 0 and d0.tokens == 0)


async def test_refused_connection_is_retried_on_another_instance(
    cluster: Cluster, proxy_factory: ProxyFactory
) -> None:
    dead = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    proxy = await proxy_factory(
        flow="direct",
        decode=[dead, cluster.decode[0].url],
        decode_policy="round_robin",
        health_interval_s=60,
        circuit_failures=3,
    )
    for _ in range(4):
        out = await proxy.client().completions.create(
            model="fake-model", prompt=PROMPT, max_tokens=1
        )
        assert out.choices[0].text == "tok0 "
    assert len(cluster.decode[0].requests()) == 4
    state = next(i for i in proxy.runtime.registry.instances() if i.url == dead)
    # round robin sent requests 1-3 to the dead one first; the third failure opened its circuit
    assert state.circuit.consecutive == 3 and state.inflight == 0
    assert state.circuit.state.value == "open"


async def test_client_hanging_up_after_done_is_a_complete_request(
    cluster: Cluster, proxy_factory: ProxyFactory
) -> None:
    """Clients (the openai one included) close as soon as they read ``[DONE]``, often before D's
    response has ended: that is a served request, not a disconnect — no abort, no 499."""
    cluster.decode[0].configure(end_delay_ms=300)
    proxy = await proxy_factory()
    body = {"model": "fake-model", "prompt": PROMPT, "max_tokens": 3, "stream": True}
    async with httpx.AsyncClient(timeout=30) as http:
        async with http.stream("POST", proxy.url + "/v1/completions", json=body) as r:
            seen = b""
            async for part in r.aiter_bytes():
                seen += part
                if b"data: [DONE]" in seen:
                    break  # hang up now, while D's response is still open
    tid = cluster.decode[0].requests()[-1]["body"]["kv_transfer_params"]["transfer_id"]
    d0 = next(i for i in proxy.runtime.registry.instances() if i.url == cluster.decode[0].url)
    await wait_until(lambda: d0.inflight == 0)
    async with proxy.http() as http:
        text = (await http.get("/metrics")).text
    assert 'outcome="client_disconnected"' not in text
    assert 'endpoint="completions",flow="decode-first",outcome="ok",status="200"' in text
    assert abandoned(cluster, tid) is None
    assert cluster.decode[0].stats()["cancelled"] == 0
