"""An instance's URL is an *origin*: ``scheme://host:port`` and nothing else.

A registered URL is where the proxy sends clients' requests and its probes (``/health``,
``/v1/models``): it gets paths appended. One that carried a path or a query
(``http://internal/admin?ignore=``) turned those calls into requests for another service's
pages, and userinfo or a fragment has no business there either. So an instance URL is the
scheme (http or https), a host (a DNS name, an IPv4 address, or an IPv6 address in brackets)
and an explicit port; hosts compare case-insensitively, so they are kept in lower case.
"""

from __future__ import annotations

import ipaddress
import re
from typing import Annotated, NamedTuple

from pydantic import AfterValidator, Field

_LABEL = r"[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?"
_ORIGIN = re.compile(
    rf"(?P<scheme>https?)://(?P<host>{_LABEL}(?:\.{_LABEL})*|\[[0-9A-Fa-f:.]+\]):(?P<port>\d{{1,5}})"
)


class Origin(NamedTuple):
    scheme: str
    host: str  # lower case; an IPv6 address without its brackets
    port: int


def parse_origin(url: str) -> Origin:
    """The origin's parts; ``ValueError`` naming what is wrong when ``url`` is not one."""
    m = _ORIGIN.fullmatch(url)
    if m is None:
        raise ValueError(
            "an instance URL is scheme://host:port (http or https, an explicit port; no path, "
            "query, fragment or user)"
        )
    host, port = m["host"].lower(), int(m["port"])
    if not 1 <= port <= 65535:
        raise ValueError(f"port {port} is out of range")
    if host.startswith("["):
        host = host[1:-1]
        try:
            ipaddress.IPv6Address(host)
        except ValueError:
            raise ValueError(f"{host!r} is not an IPv6 address") from None
    elif host.replace(".", "").isdigit():
        try:
            ipaddress.IPv4Address(host)
        except ValueError:
            raise ValueError(f"{host!r} is not an IPv4 address") from None
    return Origin(m["scheme"], host, port)


def _normalized(url: str) -> str:
    scheme, host, port = parse_origin(url)
    return f"{scheme}://{f'[{host}]' if ':' in host else host}:{port}"


# an instance URL, checked and kept in its one spelling (host in lower case)
OriginUrl = Annotated[
    str,
    Field(min_length=1, max_length=300, json_schema_extra={"pattern": f"^{_ORIGIN.pattern}$"}),
    AfterValidator(_normalized),
]
