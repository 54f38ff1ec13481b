"""Selection policies, the circuit breaker, the registry (drain) and discovery sources."""

from __future__ import annotations

import random

import pytest

from proxy.instances import (
    CircuitBreaker,
    CircuitState,
    DnsDiscovery,
    Instance,
    Registry,
    Role,
    StaticDiscovery,
    refresh,
)
from proxy.policies import POLICIES, RequestInfo, make_policy
from proxy.policies.power_of_two import PowerOfTwo
from proxy.policies.prefix import PrefixAware


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def pool(n: int, clock: Clock | None = None) -> list[Instance]:
    clk = clock or Clock()
    return [Instance(f"http://d{i}", Role.DECODE, CircuitBreaker(3, 10, clk)) for i in range(n)]


INFO = RequestInfo("hello", 2)


def test_registry_knows_every_policy_and_rejects_unknown() -> None:
    assert set(POLICIES) == {"round_robin", "random", "power_of_two", "least_load", "prefix", "kv"}
    for name in POLICIES:
        assert make_policy(name).name == name
    with pytest.raises(ValueError, match="unknown policy 'nope'"):
        make_policy("nope")


def test_round_robin_cycles() -> None:
    insts = pool(3)
    rr = make_policy("round_robin")
    assert [rr.choose(insts, INFO).url for _ in range(6)] == [i.url for i in insts] * 2


def test_random_reaches_every_instance() -> None:
    insts = pool(4)
    policy = make_policy("random")
    assert {policy.choose(insts, INFO).url for _ in range(200)} == {i.url for i in insts}


def test_least_load_prefers_fewest_inflight_then_tokens() -> None:
    a, b, c = pool(3)
    a.acquire(10)
    b.acquire(500)
    policy = make_policy("least_load")
    assert policy.choose([a, b, c], INFO) is c
    c.acquire(100)
    assert policy.choose([a, b, c], INFO) is a  # same inflight, fewer tokens
    a.release(10)
    assert a.inflight == 0 and a.tokens == 0 and a.served == 1


def test_power_of_two_never_picks_the_most_loaded_of_its_sample() -> None:
    insts = pool(3)
    insts[2].acquire(1)
    insts[2].acquire(1)
    policy = PowerOfTwo(random.Random(7))
    picks = [policy.choose(insts, INFO) for _ in range(300)]
    assert insts[2] not in picks  # any sample of two holds a less loaded instance
    assert {p.url for p in picks} == {insts[0].url, insts[1].url}


def test_prefix_sticks_to_instance_that_saw_the_prefix() -> None:
    insts = pool(3)
    policy = PrefixAware()
    shared = "system prompt " * 100
    first = RequestInfo(shared + "question one", 400)
    chosen = policy.choose(insts, first)
    policy.on_routed(chosen, first)
    chosen.acquire(1)  # now more loaded than the others, still preferred for the prefix
    again = RequestInfo(shared + "question two", 400)
    assert policy.choose(insts, again) is chosen
    assert policy.matched_blocks(chosen, again) == len(shared) // RequestInfo.BLOCK_CHARS
    other = RequestInfo("unrelated " * 100, 250)
    assert policy.choose(insts, other) is not chosen  # no match: least load


def test_prefix_memory_is_bounded() -> None:
    policy = PrefixAware(max_blocks=50)
    inst = pool(1)[0]
    for i in range(100):
        policy.on_routed(inst, RequestInfo(f"{i:04d}" + "x" * 5000, 1000))
    assert len(policy) == 50


def _state(cb: CircuitBreaker) -> CircuitState:
    """A fresh read (mypy would keep an earlier ``cb.state`` narrowed across ``record``)."""
    return cb.state


def test_circuit_opens_half_opens_and_closes() -> None:
    clock = Clock()
    cb = CircuitBreaker(failures=2, open_s=10, clock=clock)
    cb.record(False)
    assert cb.allows() and _state(cb) == CircuitState.CLOSED
    cb.record(False)
    assert _state(cb) == CircuitState.OPEN and not cb.allows() and cb.opens == 1
    clock.now += 10
    assert _state(cb) == CircuitState.HALF_OPEN and cb.allows()
    cb.on_dispatch()
    assert not cb.allows()  # one trial at a time
    cb.record(False)
    assert _state(cb) == CircuitState.OPEN
    clock.now += 10
    cb.on_dispatch()
    cb.record(True)
    assert _state(cb) == CircuitState.CLOSED and cb.allows() and cb.consecutive == 0


def test_registry_drains_removed_instance_until_idle() -> None:
    reg = Registry()
    reg.reconcile(Role.DECODE, ["http://a", "http://b"])
    a = next(i for i in reg.all(Role.DECODE) if i.url == "http://a")
    a.acquire(5)
    reg.reconcile(Role.DECODE, ["http://b"])
    assert a.draining and a in reg.all(Role.DECODE)
    assert [i.url for i in reg.available(Role.DECODE)] == ["http://b"]
    a.release(5)
    reg.sweep()
    assert [i.url for i in reg.all(Role.DECODE)] == ["http://b"]


def test_registry_available_skips_unhealthy_open_and_excluded() -> None:
    reg = Registry(circuit_failures=1)
    reg.reconcile(Role.DECODE, ["http://a", "http://b", "http://c"])
    a, b, c = sorted(reg.all(Role.DECODE), key=lambda i: i.url)
    a.healthy = False
    b.circuit.record(False)
    assert reg.available(Role.DECODE) == [c]
    assert reg.available(Role.DECODE, frozenset({"http://c"})) == []


async def test_static_discovery_fills_both_pools() -> None:
    reg = Registry()
    await refresh(StaticDiscovery(["http://p/"], ["http://d"]), reg)
    assert [i.url for i in reg.all(Role.PREFILL)] == ["http://p"]
    assert [i.url for i in reg.all(Role.DECODE)] == ["http://d"]


async def test_dns_discovery_follows_headless_service_records() -> None:
    answers = {"p.svc": ["10.0.0.1", "10.0.0.2"], "d.svc": ["10.0.1.1", "fd00::1"]}

    async def resolver(name: str, port: int) -> list[str]:
        return answers[name]

    source = DnsDiscovery("p.svc:8000", "d.svc:8001", resolver=resolver)
    reg = Registry()
    await refresh(source, reg)
    assert sorted(i.url for i in reg.all(Role.DECODE)) == [
        "http://10.0.1.1:8001",
        "http://[fd00::1]:8001",
    ]
    answers["p.svc"] = ["10.0.0.2"]
    await refresh(source, reg)
    assert [i.url for i in reg.all(Role.PREFILL)] == ["http://10.0.0.2:8000"]


def test_dns_discovery_rejects_bad_target() -> None:
    with pytest.raises(ValueError, match="NAME:PORT"):
        DnsDiscovery("nope", "d:1")
