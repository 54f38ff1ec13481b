"""The TTFT breakdown and the P:D advice (``metaserver.breakdown``, ``metaserver.advice``) on
timelines written through the real API, with the clock in the test's hands."""

from __future__ import annotations

import math
from collections.abc import AsyncIterator
from dataclasses import dataclass, replace

import httpx
import pytest

from metaserver import MetaserverSettings, create_app
from metaserver.backend import memory_backend
from metaserver.capacity.advice import Model, Pools, busy_s, erlang_wait, recommend, served_alone
from metaserver.capacity.breakdown import STAGES, Breakdown, Timeline
from metaserver.store import MemoryStore
from tests.metaserver.conftest import at, binding_spec, decode_instance


@dataclass
class Clock:
    now: float = 1_000_000.0

    def __call__(self) -> float:
        return self.now


@dataclass
class Ms:
    http: httpx.AsyncClient
    clock: Clock


@pytest.fixture
async def ms() -> AsyncIterator[Ms]:
    clock = Clock()
    store = MemoryStore(binding_ttl_s=3600, retain_s=3600)
    await store.start()
    app = create_app(MetaserverSettings(), backend=memory_backend(store), clock=clock)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url="http://ms") as c:
        for iid, role in (("decode-0", "decode"), ("prefill-0", "prefill")):
            spec = decode_instance(role=role, **at(iid)).model_dump(mode="json")
            assert (await c.put(f"/v1/instances/{iid}", json=spec)).is_success
        yield Ms(c, clock)
    await store.close()


async def transfer(
    ms: Ms,
    tid: str,
    *,
    binding_s: float = 0.05,
    queue_s: float = 0.1,
    compute_s: float = 0.4,
    exposed_s: float = 0.02,
    first_s: float = 0.03,
    marks: bool = True,
    prompt: int = 1000,
    stream_s: float | None = None,
    chunks: int = 0,
) -> None:
    """One decode-first transfer whose stages take the given seconds."""
    requested = ms.clock.now
    ms.clock.now += binding_s
    spec = binding_spec(num_prompt_tokens=prompt, num_cached_tokens=0, block_ids=[[1]])
    spec = spec.model_copy(update={"block_ids": [list(range(-(-prompt // 16)))]})
    assert (await ms.http.put(f"/v1/bindings/{tid}", content=spec.model_dump_json())).is_success
    ms.clock.now += queue_s
    await event(ms, tid, "prefill_started", "prefill-0")
    ms.clock.now += compute_s + exposed_s
    message = f"push_s={compute_s:.6f} exposed_s={exposed_s:.6f} tail_s={exposed_s:.6f}"
    await event(ms, tid, "done", "prefill-0", {"message": message})
    ms.clock.now += first_s
    if marks:
        detail = {"since_request_s": ms.clock.now - requested}
        mark = {"mark": "first_token", "actor": "proxy", "detail": detail}
        assert (await ms.http.post(f"/v1/bindings/{tid}/marks", json=mark)).status_code == 204
        if stream_s is not None:  # a streamed answer of ``chunks`` chunks, [DONE] included
            ms.clock.now += stream_s
            since = ms.clock.now - requested
            end = {"since_request_s": since, "outcome": "ok", "chunks": chunks}
            mark = {"mark": "end", "actor": "proxy", "detail": end}
            r = await ms.http.post(f"/v1/bindings/{tid}/marks", json=mark)
            assert r.status_code == 204
    ms.clock.now += 0.5  # the next request comes later


async def event(ms: Ms, tid: str, state: str, actor: str, detail: dict[str, str] | None = None):  # type: ignore[no-untyped-def]
    body = {"state": state, "actor": actor, **({"detail": detail} if detail else {})}
    r = await ms.http.post(f"/v1/bindings/{tid}/events", json=body)
    assert r.status_code == 200, r.text


async def test_breakdown_splits_ttft_into_stages_that_add_up(ms: Ms) -> None:
    for i in range(3):
        await transfer(ms, f"t{i}")
    got = (await ms.http.get("/v1/breakdown", params={"window": 60})).json()
    assert got["transfers"] == 3 and got["missing_stages"] == []
    means = {name: s["mean_s"] for name, s in got["stages"].items()}
    expected = dict(zip(STAGES, (0.05, 0.1, 0.4, 0.02, 0.03), strict=True))
    assert means == pytest.approx(expected, abs=1e-5)
    assert got["ttft"]["p90_s"] == pytest.approx(0.6, abs=1e-5)
    assert got["bottleneck"] == "prefill_compute"
    assert sum(s["share"] for s in got["stages"].values()) == pytest.approx(1, abs=1e-3)
    assert set(got["instances"]["prefill-0"]["stages"]) == {
        "prefill_queue", "prefill_compute", "push_exposed"}  # fmt: skip
    assert set(got["instances"]["decode-0"]["stages"]) == {"binding", "decode_first_token"}
    # bindings older than the window are left out
    ms.clock.now += 120
    assert (await ms.http.get("/v1/breakdown", params={"window": 60})).json()["transfers"] == 0


async def test_without_the_proxys_marks_two_stages_are_missing_and_no_counts(ms: Ms) -> None:
    await transfer(ms, "t0", marks=False)
    got = (await ms.http.get("/v1/breakdown", params={"ttft_p90": 0.5})).json()
    assert got["missing_stages"] == ["binding", "decode_first_token"] and got["ttft"] is None
    assert "recommended" not in got["advice"]
    assert "first_token marks" in got["advice"]["reasoning"]


async def test_d_floor_is_looked_for_before_the_window(ms: Ms) -> None:
    async def loaded_window() -> dict[str, int]:
        tids = [f"busy-{ms.clock.now}-{i}" for i in range(20)]
        for tid in tids:  # every D stage loaded alike: no quiet moment in the window
            await transfer(ms, tid, binding_s=0.6, first_s=0.4)
        for tid in tids:  # every answer streams until the last one's: all at D together
            end = {"mark": "end", "actor": "proxy", "detail": {"outcome": "ok"}}
            assert (await ms.http.post(f"/v1/bindings/{tid}/marks", json=end)).status_code == 204
        params = {"window": 45, "ttft_p90": 0.76}
        got = (await ms.http.get("/v1/breakdown", params=params)).json()
        assert got["transfers"] == 20 and got["bottleneck"] == "binding"
        return got["advice"]["recommended"]

    assert (await loaded_window())["decode"] == 1  # its own floor is loaded: D gains nothing
    ms.clock.now += 600  # the loaded transfers age out of the next window, not of the lookback
    for i in range(5):  # one at a time: each alone at D
        await transfer(ms, f"quiet-{i}", binding_s=0.01, first_s=0.01)
    ms.clock.now += 600
    assert (await loaded_window())["decode"] > 1


async def test_itl_is_the_mean_gap_between_streamed_tokens(ms: Ms) -> None:
    await transfer(ms, "t0", stream_s=1.0, chunks=52)  # 50 gaps of 20 ms after the first token
    await transfer(ms, "t1", stream_s=0.3, chunks=12)  # 10 gaps of 30 ms
    await transfer(ms, "t2", stream_s=0.0, chunks=2)  # one token: no gap
    await transfer(ms, "t3")  # no end mark (not streamed, or not ended yet)
    got = (await ms.http.get("/v1/breakdown", params={"window": 60, "itl_p90": 0.025})).json()
    assert got["itl"]["count"] == 2
    assert got["itl"]["p50_s"] == pytest.approx(0.02) and got["itl"]["p90_s"] == pytest.approx(0.03)
    assert got["instances"]["decode-0"]["itl"]["count"] == 2
    advice = got["advice"]
    assert advice["itl_target_p90_s"] == 0.025 and advice["target_p90_s"] is None
    assert "p90 inter-token latency 30.0 ms" in advice["reasoning"]
    assert "p90 ITL" in advice["reasoning"]
    r = await ms.http.get("/v1/breakdown", params={"itl_p90": 0})
    assert r.status_code == 422


def test_advice_grows_d_for_an_itl_target_alone() -> None:
    b = timelines(100, 100.0)  # P and D stages light: TTFT is met by far
    for i, t in enumerate(b.timelines):  # ITL 20 ms on a quiet D, 60 ms loaded
        b.timelines[i] = replace(t, itl=0.02 if i % 10 == 0 else 0.06)
    b = Breakdown.of(b.timelines, 100.0)
    m = Model.of(b, Pools(prefill=2, decode=2))
    assert m.itl_p90(m.now) == pytest.approx(0.06)
    out = recommend(m, target_p90_s=None, itl_target_p90_s=0.04)
    # p90 60 ms moves by the mean's part above the 20 ms floor (36 ms) x (2/c - 1): 4 D give
    # 42 ms, 5 D 38.4 ms; P, 15% busy, may shrink
    assert out["recommended"] == {"prefill": 1, "decode": 5}, out["reasoning"]
    assert out["recommended_itl_p90_s"] == pytest.approx(0.0384)
    assert "which meets the target 40.0 ms" in out["reasoning"]
    both = recommend(m, target_p90_s=1.0, itl_target_p90_s=0.04)
    assert both["recommended"]["decode"] == 5
    assert "which meet the targets 1.000 s and 40.0 ms" in both["reasoning"]
    unknown = recommend(Model.of(timelines(10, 100.0), Pools(2, 2)), None, 0.04)
    assert "recommended" not in unknown and "no inter-token latency" in unknown["reasoning"]


def test_served_alone_means_no_other_transfer_at_that_d_meanwhile() -> None:
    def at(name: str, d: str, start: float, end: float | None) -> Timeline:
        span = None if end is None else (start, end)
        return Timeline(name, d, "p", {}, 10, 0, start, span=span)

    ts = [
        at("a", "d0", 0, 1),  # alone
        at("b", "d0", 2, 5),  # overlaps c
        at("c", "d0", 3, 4),  # inside b
        at("d", "d0", 5, 6),  # starts as b ends: alone
        at("e", "d1", 3, 4),  # another D: alone there
        at("f", "d0", 7, None),  # no marks: not known
        at("g", "d0", 6.5, 9),  # f's span unknown: counted alone
    ]
    assert [t.transfer_id for t in served_alone(ts)] == ["a", "d", "g", "e"]


def timelines(n: int, window_s: float, **stages: float) -> Breakdown:
    """``n`` transfers evenly over the window, alternating between two P and two D."""
    base = dict(zip(STAGES, (0.02, 0.05, 0.3, 0.01, 0.03), strict=True)) | stages
    gap = window_s / n
    ts = [
        Timeline(f"t{i}", f"decode-{i % 2}", f"prefill-{i % 2}", dict(base), 2000, 0, i * gap)
        for i in range(n)
    ]
    return Breakdown.of(ts, window_s)


def test_erlang_wait_is_mm1_for_one_server_and_shrinks_with_servers() -> None:
    assert erlang_wait(1, 0.5, 1.0) == pytest.approx(0.5 / (1 - 0.5))  # ρ/(1−ρ)·S
    assert erlang_wait(2, 1.5, 1.0) > erlang_wait(3, 1.5, 1.0) > erlang_wait(4, 1.5, 1.0)
    assert math.isinf(erlang_wait(2, 2.0, 1.0)) and erlang_wait(3, 0.0, 1.0) == 0.0


def test_advice_grows_p_when_p_queueing_dominates() -> None:
    # 2 P, each 93% busy (6 transfers/s × 0.31 s ÷ 2): most requests wait 1.3 s for a P,
    # the luckiest only the 10 ms hop
    ts = timelines(600, 100.0, prefill_queue=1.3).timelines
    for t in ts[::10]:
        t.stages["prefill_queue"] = 0.01
    b = Breakdown.of(ts, 100.0)
    m = Model.of(b, Pools(prefill=2, decode=2))
    assert m.busy(2) == pytest.approx(0.93, abs=0.01)
    out = recommend(m, target_p90_s=0.8)
    assert out["recommended"]["prefill"] > 2 and out["recommended"]["decode"] <= 2
    assert out["recommended_p90_s"] <= 0.8
    assert "prefill_queue is" in out["reasoning"] and "P instead of 2" in out["reasoning"]


def test_advice_grows_d_when_d_stages_dominate() -> None:
    # D's stages vary: a few fast (the floor) and most slow: load on D
    ts = timelines(100, 100.0, binding=0.6, decode_first_token=0.4).timelines
    for t in ts[::10]:
        t.stages.update(binding=0.02, decode_first_token=0.03)
    b = Breakdown.of(ts, 100.0)
    out = recommend(Model.of(b, Pools(prefill=2, decode=2)), target_p90_s=0.8)
    assert out["recommended"]["decode"] > 2 and out["recommended"]["prefill"] <= 2


def test_d_floor_comes_from_the_lookback_when_the_window_is_loaded_throughout() -> None:
    # a burst keeps every D loaded all window: its own 10th percentile is a loaded D
    b = timelines(100, 100.0, binding=0.6, decode_first_token=0.4)
    alone = recommend(Model.of(b, Pools(prefill=2, decode=2)), target_p90_s=0.8)
    assert alone["recommended"]["decode"] == 2  # nothing above the floor: no gain from D
    # an earlier quiet stretch shows what an unloaded D takes: each transfer alone at its D
    quiet = timelines(20, 100.0, binding=0.02, decode_first_token=0.03).timelines
    quiet = [replace(t, span=(t.at - 0.1, t.at)) for t in quiet]
    model = Model.of(b, Pools(prefill=2, decode=2), history=[*quiet, *b.timelines])
    assert model.decode_floor_s == pytest.approx(0.05)
    out = recommend(model, target_p90_s=0.8)
    assert out["recommended"]["decode"] > 2 and out["recommended"]["prefill"] <= 2
    assert out["recommended_p90_s"] <= 0.8


def test_advice_shrinks_an_idle_pool_when_the_target_is_met() -> None:
    b = timelines(50, 100.0)  # 0.5 transfers/s: P 4% busy
    out = recommend(Model.of(b, Pools(prefill=4, decode=2)), target_p90_s=2.0)
    assert out["recommended"]["prefill"] < 4
    assert out["recommended_p90_s"] <= 2.0
    assert out["disaggregation"]["prefill_idle"] is True


def test_disaggregation_suggests_a_minimum_prompt_length() -> None:
    short = [
        Timeline(f"s{i}", "d", "p", dict(zip(STAGES, (0.02, 0.01, 0.02, 0.02, 0.03),
                                              strict=True)), 100, 0, 0.0)
        for i in range(20)
    ]  # fmt: skip
    long = [
        Timeline(f"l{i}", "d", "p", dict(zip(STAGES, (0.02, 0.01, 0.5, 0.01, 0.03),
                                              strict=True)), 3000, 0, 0.0)
        for i in range(20)
    ]  # fmt: skip
    out = recommend(Model.of(Breakdown.of(short + long, 100.0), Pools(1, 1)), None)
    d = out["disaggregation"]
    assert d["suggested_min_tokens"] == 2048 and d["pays_by_prompt_tokens"] == {
        "64": False, "2048": True}  # fmt: skip
    assert "prompts under 2048" in d["text"]


def test_busy_time_is_the_union_of_overlapping_spans() -> None:
    assert busy_s([(0, 2), (1, 3), (5, 6), (5.5, 5.7)]) == pytest.approx(4.0)
    assert busy_s([]) == 0.0


def test_a_saturated_pool_gets_a_finite_prediction_with_more_p() -> None:
    """A burst: 8 long prompts at once on 2 P, whose chunks vLLM interleaves: each P busy the
    whole 30 s, every transfer's compute stretched over its P's others."""
    ts = []
    for i in range(8):
        stages = dict(zip(STAGES, (0.05, 2.0 * (i // 2), 30.0 - 2.0 * (i // 2), 0.01, 0.05),
                          strict=True))  # fmt: skip
        ts.append(Timeline(f"t{i}", f"decode-{i % 2}", f"prefill-{i % 2}", stages, 1500, 0, 30.0))
    m = Model.of(Breakdown.of(ts, 30.0), Pools(prefill=2, decode=2))
    assert m.busy(2) == pytest.approx(1.0, abs=0.01) and m.service_s == pytest.approx(7.5, 0.01)
    out = recommend(m, target_p90_s=15.0)
    assert out["recommended"]["prefill"] >= 3 and out["recommended_p90_s"] <= 15.0, out
