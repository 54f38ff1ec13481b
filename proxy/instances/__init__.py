"""Instances: the registry of both pools, circuit breakers, health probes, discovery and
drains."""

from proxy.instances.circuit import CircuitBreaker, CircuitState
from proxy.instances.discovery import (
    DiscoverySource,
    DnsDiscovery,
    MetaserverDiscovery,
    StaticDiscovery,
    refresh,
    run_discovery,
)
from proxy.instances.drain import DrainControl, DrainResult, DrainWatch
from proxy.instances.health import HealthChecker
from proxy.instances.instance import Instance, Role, unpairable
from proxy.instances.registry import Registry

__all__ = [
    "CircuitBreaker",
    "CircuitState",
    "DiscoverySource",
    "DnsDiscovery",
    "DrainControl",
    "DrainResult",
    "DrainWatch",
    "HealthChecker",
    "Instance",
    "MetaserverDiscovery",
    "Registry",
    "Role",
    "StaticDiscovery",
    "refresh",
    "run_discovery",
    "unpairable",
]
