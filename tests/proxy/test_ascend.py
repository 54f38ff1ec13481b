"""``--flow ascend-layerwise`` end to end: the real proxy, two real metaservers on one real Redis,
fakes of vllm-ascend's D and P (``tests/fakes/ascend.py``: what ``MooncakeLayerwiseConnector``
sends and expects, ZMQ side channel included) and the official ``openai`` client.

vllm-ascend's scheduler-side connector cannot be driven with vLLM's real ``Scheduler`` here:
``vllm_ascend/distributed/kv_transfer/kv_p2p/mooncake_layerwise_connector.py`` imports
``torch_npu`` and ``mooncake.engine.TransferEngine`` at module top (and ``vllm_ascend``'s
``ascend_config`` / NPU platform at construction), none of which installs or imports on a CPU
machine; the scheduler class cannot be imported without them. The fakes are derived from that
file instead (``update_state_after_alloc``, ``_access_metaserver``, ``send_done_send_signal``,
``KVCacheRecvingLayerThread.run``; see the fake's docstring).
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest

from pdwire.ascend import COMPAT_PATH
from pdwire.trace import format_traceparent
from tests.fakes import FakeVLLM
from tests.proxy.conftest import Cluster, ProxyFactory, wait_until
from tests.support.otlp import ReceivedSpan, otlp_receiver
from tests.support.procs import free_port
from tests.support.services import MetaserverProcess, RedisServer

FLOW = "ascend-layerwise"


class Ascend(FakeVLLM):
    """A fake vllm-ascend engine process (``tests.fakes.ascend``) with its side-channel port."""

    def __init__(self, role: str, kv_port: int, log_dir: Any) -> None:
        self.kv_port = kv_port
        super().__init__(
            role, log_dir=log_dir, module="tests.fakes.ascend", extra=["--kv-port", str(kv_port)]
        )


@pytest.fixture(scope="module")
def cluster(
    redis_server: RedisServer, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Cluster]:
    """Two metaservers (A = ``metaserver``, B = ``extra``) on one Redis; two fake P, two fake
    D. D's side-channel ports form the decode pool; one more port is outside it."""
    logs = tmp_path_factory.mktemp("ascend")
    started: list[Any] = []
    try:
        kv = [free_port(), free_port()]
        pool = ",".join(f"127.0.0.1:{p}" for p in kv)
        ms = [
            MetaserverProcess(
                redis_server.url,
                "--namespace",
                "ascend-e2e",
                "--ascend-decode",
                pool,
                "--ascend-refresh",
                "0.2",
                log_dir=logs,
            )  # fmt: skip
            for _ in range(2)
        ]
        started += ms
        prefill = [Ascend("prefill", free_port(), logs) for _ in range(2)]
        started += prefill
        decode = [Ascend("decode", p, logs) for p in kv]
        started += decode
        c = Cluster(ms[0], list(prefill), list(decode))
        c.extra = ms[1]  # type: ignore[attr-defined]
        yield c
    finally:
        for s in reversed(started):
            s.stop()


def _ms_b(cluster: Cluster) -> MetaserverProcess:
    ms: MetaserverProcess = cluster.extra  # type: ignore[attr-defined]
    return ms


def _settings(cluster: Cluster, **over: Any) -> dict[str, Any]:
    return {"flow": FLOW, "binding_wait_s": 3.0, **over}


def _binding(ms: MetaserverProcess, rid: str) -> dict[str, Any]:
    r = httpx.get(f"{ms.url}/v1/bindings/{rid}", timeout=5)
    assert r.status_code == 200, r.text
    out: dict[str, Any] = r.json()
    return out


def _states(ms: MetaserverProcess, rid: str) -> list[str]:
    return [e["state"] for e in _binding(ms, rid)["events"]]


def _abandoned(ms: MetaserverProcess, rid: str) -> str | None:
    """The outcome of the proxy's ``abandoned`` mark on the binding (None: no such mark)."""
    marks = [m for m in _binding(ms, rid).get("marks", []) if m["mark"] == "abandoned"]
    return str(marks[0]["detail"]["outcome"]) if marks else None


async def test_ascend_completions_legs_carry_vllm_ascend_params(
    cluster: Cluster, proxy_factory: ProxyFactory
) -> None:
    proxy = await proxy_factory(**_settings(cluster))
    client = proxy.client()
    out = await client.completions.create(model="fake-model", prompt="hello " * 40, max_tokens=5)
    assert out.choices[0].text
    d, p = cluster.decode[0], cluster.prefill[0]
    (d_req,) = d.requests()
    (p_req,) = p.requests()
    x = d_req["x_request_id"]
    assert x.startswith("pd-") and p_req["x_request_id"] == x  # P's ids equal D's
    assert d_req["body"]["kv_transfer_params"] == {
        "do_remote_decode": False,
        "do_remote_prefill": True,
        "metaserver": cluster.metaserver.url + COMPAT_PATH,
    }
    assert d_req["body"]["max_tokens"] == 5
    kv = p_req["body"]["kv_transfer_params"]
    assert kv["request_id"] == f"cmpl-{x}-0"
    assert kv["remote_host"] == "127.0.0.1" and kv["remote_port"] == d.kv_port  # type: ignore[attr-defined]
    assert kv["do_remote_decode"] is True and kv["do_remote_prefill"] is False
    assert kv["remote_cached_tokens"] == 0 and kv["token_ids"] == []
    assert "batch_kv_transfer_params" not in kv
    assert p_req["body"]["max_tokens"] == 1 and p_req["body"]["stream"] is False
    stats = d.stats()
    assert stats["kv_received"] == 1
    assert stats["metaserver_answers"] == [[f"cmpl-{x}-0", 200]]
    assert p.stats()["signals_sent"] == 1
    # the event history, as curl shows it
    assert _states(cluster.metaserver, f"cmpl-{x}-0") == ["bound"]


async def test_ascend_legs_are_traced(
    cluster: Cluster, proxy_factory: ProxyFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Tracing on, the ascend flow's request has the spans decode-first's has: D's leg, the
    wait for D's binding, P's leg, each a child of the client's trace, and each engine is sent
    its own leg's span as ``traceparent``."""
    monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "100")  # exported within 0.1 s, not 5 s
    trace_id, parent = 0x5AF1C3D2E4B5A6978877665544332211, 0x1122334455667788
    with otlp_receiver() as receiver:
        proxy = await proxy_factory(**_settings(cluster), otlp_traces_endpoint=receiver.url)
        out = await proxy.client().completions.create(
            model="fake-model", prompt="hello " * 40, max_tokens=5,
            extra_headers={"traceparent": format_traceparent(trace_id, parent, 1)},
        )  # fmt: skip
        assert out.choices[0].text

        def whole(spans: list[ReceivedSpan]) -> bool:
            return len(spans) >= 4

        spans = await asyncio.to_thread(receiver.wait, f"{trace_id:032x}", whole)
    got = {s.name: s for s in spans}
    assert sorted(got) == [
        "pdgate.binding_wait", "pdgate.decode", "pdgate.prefill", "pdgate.request"
    ], [s.name for s in spans]  # fmt: skip
    root = got["pdgate.request"]
    assert root.parent_span_id == f"{parent:016x}"
    assert root.attributes["pdgate.flow"] == FLOW
    for leg in ("pdgate.decode", "pdgate.binding_wait", "pdgate.prefill"):
        assert got[leg].parent_span_id == root.span_id, leg
    (d_req,) = cluster.decode[0].requests()
    (p_req,) = cluster.prefill[0].requests()
    for req, leg in ((d_req, "pdgate.decode"), (p_req, "pdgate.prefill")):
        assert req["traceparent"] == format_traceparent(trace_id, int(got[leg].span_id, 16), 1)


async def test_ascend_completions_batch_of_prompts(
    cluster: Cluster, proxy_factory: ProxyFactory
) -> None:
    proxy = await proxy_factory(**_settings(cluster))
    prompts = ["first prompt " * 20, "second " * 50, "third " * 5]
    out = await proxy.client().completions.create(model="fake-model", prompt=prompts, max_tokens=3)
    assert sorted(c.index for c in out.choices) == [0, 1, 2]
    (d_req,) = cluster.decode[0].requests()
    (p_req,) = cluster.prefill[0].requests()
    x = d_req["x_request_id"]
    ids = [f"cmpl-{x}-{i}" for i in range(3)]
    assert d_req["ids"] == ids == p_req["ids"]
    kv = p_req["body"]["kv_transfer_params"]
    batch = kv.pop("batch_kv_transfer_params")
    assert list(batch) == ids
    assert kv == batch[ids[0]]  # the top level is child 0's, as the example proxy sends it
    blocks = [batch[i]["remote_block_ids"] for i in ids]
    assert len({str(b) for b in blocks}) == 3  # each child's own blocks on D
    assert p_req["body"]["prompt"] == prompts
    assert cluster.decode[0].stats()["kv_received"] == 1  # all three children signalled


async def test_ascend_bindings_come_from_the_binding_feed(
    cluster: Cluster, proxy_factory: ProxyFactory
) -> None:
    # D's request ids (cmpl-T-i, chatcmpl-T) are built from the proxy's transfer ids, so its
    # one feed carries them: no long-poll per request
    proxy = await proxy_factory(**_settings(cluster))
    rt = proxy.runtime
    assert rt.bindings is not None and rt.bindings.feed is not None
    feed = rt.bindings.feed
    await wait_until(lambda: feed.live, within=10)
    client = proxy.client()
    await client.completions.create(
        model="fake-model", prompt=["one " * 9, "two " * 7], max_tokens=2
    )
    await client.chat.completions.create(
        model="fake-model", messages=[{"role": "user", "content": "hi " * 12}], max_tokens=2
    )
    assert rt.metrics.binding_reads_feed.value == 3  # two children and one chat request
    assert rt.metrics.binding_reads_long_poll.value == 0


async def test_ascend_chat_streaming(cluster: Cluster, proxy_factory: ProxyFactory) -> None:
    proxy = await proxy_factory(**_settings(cluster))
    stream = await proxy.client().chat.completions.create(
        model="fake-model",
        messages=[{"role": "user", "content": "tell me " * 30}],
        max_tokens=6,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = [c async for c in stream]
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text and chunks[-1].usage is not None
    (d_req,) = cluster.decode[0].requests()
    (p_req,) = cluster.prefill[0].requests()
    x = d_req["x_request_id"]
    assert d_req["ids"] == [f"chatcmpl-{x}"]
    assert p_req["body"]["kv_transfer_params"]["request_id"] == f"chatcmpl-{x}"
    assert p_req["body"]["stream"] is False and "stream_options" not in p_req["body"]
    assert d_req["body"]["stream"] is True


async def test_ascend_client_kv_params_are_stripped(
    cluster: Cluster, proxy_factory: ProxyFactory
) -> None:
    proxy = await proxy_factory(**_settings(cluster))
    evil = {"do_remote_prefill": True, "metaserver": "http://evil.example/x"}
    await proxy.client().completions.create(
        model="fake-model", prompt="hi " * 30, max_tokens=2, extra_body={"kv_transfer_params": evil}
    )
    (d_req,) = cluster.decode[0].requests()
    assert d_req["body"]["kv_transfer_params"]["metaserver"] == cluster.metaserver.url + COMPAT_PATH


async def test_ascend_decode_failing_retries_on_another_pair(
    cluster: Cluster, proxy_factory: ProxyFactory
) -> None:
    d0, d1 = cluster.decode
    d0.configure(error_status=503)
    proxy = await proxy_factory(
        **_settings(cluster, decode=[d0.url, d1.url], decode_policy="round_robin")
    )
    for _ in range(2):
        out = await proxy.client().completions.create(
            model="fake-model", prompt="x " * 30, max_tokens=2
        )
        assert out.choices[0].text
    assert d1.stats()["kv_received"] == 2


async def test_ascend_prefill_failing_retries_and_marks_failed(
    cluster: Cluster, proxy_factory: ProxyFactory
) -> None:
    p0, p1 = cluster.prefill
    p0.configure(error_status=500)
    proxy = await proxy_factory(
        **_settings(cluster, prefill=[p0.url], decode=[cluster.decode[0].url], retries=0)
    )
    with pytest.raises(openai.APIStatusError) as err:
        await proxy.client().completions.create(model="fake-model", prompt="y " * 30, max_tokens=2)
    assert err.value.status_code == 502
    (d_req,) = cluster.decode[0].requests()
    rid = f"cmpl-{d_req['x_request_id']}-0"
    await wait_until(lambda: _abandoned(cluster.metaserver, rid) == "failed")
    await wait_until(lambda: rid in cluster.decode[0].stats()["aborted"])  # D's leg dropped
    # with a second P the retry gets a new pair and a new request id
    proxy2 = await proxy_factory(**_settings(cluster, prefill=[p0.url, p1.url], retries=2))
    out = await proxy2.client().completions.create(
        model="fake-model", prompt="z " * 30, max_tokens=2
    )
    assert out.choices[0].text
    assert p1.stats()["signals_sent"] >= 1


async def test_ascend_push_failure_reaches_client_as_error(
    cluster: Cluster, proxy_factory: ProxyFactory
) -> None:
    cluster.prefill[0].configure(fail_push=True)
    proxy = await proxy_factory(**_settings(cluster, retries=0))
    with pytest.raises(openai.APIStatusError) as err:
        await proxy.client().completions.create(model="fake-model", prompt="q " * 30, max_tokens=2)
    assert err.value.status_code >= 500  # an error, not a 200 with an empty body
    assert cluster.decode[0].stats()["kv_failed"] == 1


async def test_ascend_client_disconnect_aborts_both_legs(
    cluster: Cluster, proxy_factory: ProxyFactory
) -> None:
    p = cluster.prefill[0]
    p.configure(prefill_delay_ms=3000)
    proxy = await proxy_factory(**_settings(cluster))
    client = proxy.client(timeout=0.8)
    with pytest.raises(openai.APITimeoutError):
        await client.completions.create(model="fake-model", prompt="w " * 30, max_tokens=2)
    (d_req,) = cluster.decode[0].requests()
    rid = f"cmpl-{d_req['x_request_id']}-0"
    await wait_until(lambda: rid in cluster.decode[0].stats()["aborted"])
    await wait_until(lambda: rid in p.stats()["aborted"])
    await wait_until(lambda: _abandoned(cluster.metaserver, rid) == "aborted")


async def test_ascend_binding_outside_pool_is_refused(
    cluster: Cluster, proxy_factory: ProxyFactory, tmp_path_factory: pytest.TempPathFactory
) -> None:
    rogue = Ascend("decode", free_port(), tmp_path_factory.mktemp("rogue"))
    try:
        proxy = await proxy_factory(**_settings(cluster, decode=[rogue.url], binding_wait_s=0.5,
                                                retries=0))  # fmt: skip
        with pytest.raises(openai.APIStatusError) as err:
            await proxy.client().completions.create(
                model="fake-model", prompt="r " * 30, max_tokens=2
            )
        assert err.value.status_code == 504
        answers = rogue.stats()["metaserver_answers"]
        assert [status for _, status in answers] == [422]
        assert cluster.prefill[0].requests() == []  # P was never told to push there
    finally:
        rogue.stop()


async def test_ascend_two_proxies_two_metaservers(
    cluster: Cluster, proxy_factory: ProxyFactory
) -> None:
    """A request entering proxy A (long-polling metaserver A) whose D posts to metaserver B
    completes, and the other way round: the binding travels through Redis."""
    ms_a, ms_b = cluster.metaserver, _ms_b(cluster)
    a = await proxy_factory(
        **_settings(cluster, metaserver=ms_a.url, ascend_callback_url=ms_b.url + COMPAT_PATH)
    )
    b = await proxy_factory(
        **_settings(cluster, metaserver=ms_b.url, ascend_callback_url=ms_a.url + COMPAT_PATH)
    )
    outs = await asyncio.gather(
        *(
            proxy.client().completions.create(model="fake-model", prompt="m " * 30, max_tokens=2)
            for proxy in (a, b, a, b)
        )
    )
    assert all(o.choices[0].text for o in outs)
    seen = cluster.decode[0].requests()
    urls = sorted(r["body"]["kv_transfer_params"]["metaserver"] for r in seen)
    assert urls == sorted([ms_a.url + COMPAT_PATH] * 2 + [ms_b.url + COMPAT_PATH] * 2)
    for r in seen:
        rid = r["ids"][0]
        assert _binding(ms_a, rid) == _binding(ms_b, rid)  # either replica serves it
