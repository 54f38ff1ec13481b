"""One backend vLLM server as the proxy sees it: health, load, circuit, drain."""

from __future__ import annotations

import enum
from typing import Any
from urllib.parse import urlsplit

from pdwire.compat import Mismatch, instances_problem
from pdwire.models import InstanceSpec
from proxy.instances.circuit import CircuitBreaker
from proxy.instances.work import RecentWork


class Role(enum.StrEnum):
    PREFILL = "prefill"
    DECODE = "decode"


def local_id(url: str) -> str:
    """The id of an instance the metaserver registry does not name: its ``host:port``."""
    return urlsplit(url).netloc


def unpairable(p: Instance, d: Instance) -> Mismatch | None:
    """Why P instance ``p`` must not push into D instance ``d`` by their registrations
    (revision, KV identity, TP pairing); ``None``: it may. An instance the registry does not
    describe is not held back."""
    if p.spec is None or d.spec is None:
        return None
    return instances_problem(p.spec, d.spec)


class Instance:
    """Load counters are plain ints (one event loop per process); ``acquire``/``release`` pair up
    in a ``finally`` around every leg.

    Two ways out of selection that keep the instance known: ``draining`` (it left discovery: it
    is forgotten once idle) and a *drain* (``drained_remote``: its registration in the
    metaserver says ``draining``, seen by every proxy; ``drained_local``: an admin call on this
    proxy for an instance the registry does not know). In-flight requests finish either way."""

    __slots__ = (
        "__weakref__",
        "cache_epoch",
        "circuit",
        "drained_local",
        "drained_remote",
        "draining",
        "healthy",
        "id",
        "inflight",
        "remote_inflight",
        "remote_open",
        "remote_tokens",
        "role",
        "served",
        "slow",
        "spec",
        "tokens",
        "url",
        "work",
    )

    def __init__(self, url: str, role: Role, circuit: CircuitBreaker) -> None:
        self.url = url
        self.role = role
        self.circuit = circuit
        self.healthy = True
        self.slow = False  # its last failed health probe timed out (busy, not down)
        self.draining = False
        self.drained_remote = False
        self.drained_local = False
        self.id = local_id(url)  # the registry's instance id once the metaserver names it
        self.inflight = 0
        self.tokens = 0
        # the other proxy replicas' in-flight load on it, and whether one of them has its
        # circuit open (``proxy.instances.share``; 0 / False without --share-load)
        self.remote_inflight = 0
        self.remote_tokens = 0
        self.remote_open = False
        self.cache_epoch = 0  # D: bumped when its prefix cache may hold wrong KV (integrity)
        self.served = 0
        self.work = RecentWork()  # prefill tokens sent lately (the kv policy's ties)
        # its registration in the metaserver (revision, KV identity, TP): None when the
        # registry does not know it (a static URL of an engine without the connector)
        self.spec: InstanceSpec | None = None

    def available(self) -> bool:
        return (
            self.healthy
            and not self.draining
            and not self.drained_remote
            and not self.drained_local
            and self.circuit.allows()
            and not self.remote_open
        )

    @property
    def load(self) -> tuple[int, int]:
        """In-flight requests and tokens, every proxy replica's (``--share-load``)."""
        return (self.inflight + self.remote_inflight, self.tokens + self.remote_tokens)

    @property
    def drained(self) -> bool:
        return self.drained_remote or self.drained_local

    def acquire(self, tokens: int) -> None:
        self.inflight += 1
        self.tokens += tokens
        self.circuit.on_dispatch()

    def release(self, tokens: int) -> None:
        self.inflight -= 1
        self.tokens -= tokens
        self.served += 1

    def describe(self) -> dict[str, Any]:
        by = [
            n
            for n, on in (("metaserver", self.drained_remote), ("proxy", self.drained_local))
            if on
        ]
        return {
            "id": self.id,
            "url": self.url,
            "role": self.role.value,
            "healthy": self.healthy,
            "draining": self.draining,
            "drained": bool(by),
            "drained_by": by,
            "circuit": self.circuit.state.value,
            "consecutive_failures": self.circuit.consecutive,
            "inflight": self.inflight,
            "tokens": self.tokens,
            "other_replicas_inflight": self.remote_inflight,
            "served": self.served,
            "revision": self.spec.revision if self.spec is not None else None,
        }

    def __repr__(self) -> str:
        return f"Instance({self.role.value} {self.url})"
