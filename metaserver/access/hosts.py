"""The hosts an engine credential may register: its URL's host and its KV endpoint's host must
be one of them. Addresses and networks (``10.0.3.0/24``) match any address inside; DNS names
match themselves, case-insensitively (a name is not resolved: list the name the engine
registers). On Kubernetes the pod's own addresses, from the API (``metaserver.access.kube``)."""

from __future__ import annotations

import ipaddress
from collections.abc import Iterable
from dataclasses import dataclass

Network = ipaddress.IPv4Network | ipaddress.IPv6Network


@dataclass(frozen=True, slots=True)
class Hosts:
    networks: tuple[Network, ...]
    names: frozenset[str]

    @classmethod
    def parse(cls, entries: Iterable[str]) -> Hosts:
        """``ValueError`` naming an entry that is neither an address, a network nor a name."""
        networks: list[Network] = []
        names: set[str] = set()
        for entry in entries:
            text = entry.strip().lower()
            try:
                networks.append(ipaddress.ip_network(text, strict=False))
                continue
            except ValueError:
                pass
            if not text or "/" in text or not all(c.isalnum() or c in ".-" for c in text):
                raise ValueError(f"{entry!r} is not an address, a network or a host name")
            names.add(text)
        return cls(tuple(networks), frozenset(names))

    def allows(self, host: str) -> bool:
        try:
            address = ipaddress.ip_address(host)
        except ValueError:
            return host.lower() in self.names
        return any(address in net for net in self.networks)
