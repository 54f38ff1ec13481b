"""Selection policies: one small module each, one interface (``Policy``), one registry.

``make_policy("least_load")``; names: round_robin, random, power_of_two, least_load, prefix,
kv.
"""

from __future__ import annotations

from collections.abc import Callable

from proxy.policies.base import KVMatch, Policy, RequestInfo
from proxy.policies.kv import KVAware
from proxy.policies.least_load import LeastLoad
from proxy.policies.power_of_two import PowerOfTwo
from proxy.policies.prefix import PrefixAware
from proxy.policies.random import RandomChoice
from proxy.policies.round_robin import RoundRobin

POLICIES: dict[str, Callable[[], Policy]] = {
    "round_robin": RoundRobin,
    "random": RandomChoice,
    "power_of_two": PowerOfTwo,
    "least_load": LeastLoad,
    "prefix": PrefixAware,
    "kv": KVAware,
}


def make_policy(name: str) -> Policy:
    try:
        return POLICIES[name]()
    except KeyError:
        raise ValueError(f"unknown policy {name!r}; choose one of {', '.join(POLICIES)}") from None


__all__ = ["POLICIES", "KVMatch", "Policy", "RequestInfo", "make_policy"]
