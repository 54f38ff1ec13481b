"""One backend vLLM server as the proxy sees it: health, load, circuit, drain."""

from __future__ import annotations

import enum
from typing import Any

from proxy.instances.circuit import CircuitBreaker


class Role(enum.StrEnum):
    PREFILL = "prefill"
    DECODE = "decode"


class Instance:
    """Load counters are plain ints (one event loop per process); ``acquire``/``release`` pair up
    in a ``finally`` around every leg."""

    __slots__ = (
        "__weakref__",
        "circuit",
        "draining",
        "healthy",
        "inflight",
        "role",
        "served",
        "slow",
        "tokens",
        "url",
    )

    def __init__(self, url: str, role: Role, circuit: CircuitBreaker) -> None:
        self.url = url
        self.role = role
        self.circuit = circuit
        self.healthy = True
        self.slow = False  # its last failed health probe timed out (busy, not down)
        self.draining = False
        self.inflight = 0
        self.tokens = 0
        self.served = 0

    def available(self) -> bool:
        return self.healthy and not self.draining and self.circuit.allows()

    def acquire(self, tokens: int) -> None:
        self.inflight += 1
        self.tokens += tokens
        self.circuit.on_dispatch()

    def release(self, tokens: int) -> None:
        self.inflight -= 1
        self.tokens -= tokens
        self.served += 1

    def describe(self) -> dict[str, Any]:
        return {
            "url": self.url,
            "role": self.role.value,
            "healthy": self.healthy,
            "draining": self.draining,
            "circuit": self.circuit.state.value,
            "consecutive_failures": self.circuit.consecutive,
            "inflight": self.inflight,
            "tokens": self.tokens,
            "served": self.served,
        }

    def __repr__(self) -> str:
        return f"Instance({self.role.value} {self.url})"
