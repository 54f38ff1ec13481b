"""The Redis store's connection pool: one Redis, or the master a set of Sentinels names.

``redis://``, ``rediss://`` and ``unix://`` URLs name one server (redis-py parses them).
``redis+sentinel://[[user]:password@]host:port[,host:port...]/service[/db]`` names Sentinels;
the pool asks them for the master of ``service`` when it connects, and again after a connection
fails, so a failover moves the store to the promoted replica by itself (the store's retries
bridge the seconds it takes). ``password`` is the master's; a ``sentinel_password`` query
parameter authenticates to the Sentinels. ``rediss+sentinel://`` uses TLS to the master, trusting
the CA file of a ``ssl_ca_certs`` query parameter (as ``rediss://`` URLs do) or the system's.

Either way the pool blocks (``timeout``) rather than fail when its ``max_connections`` are in use.
``RedisLink`` is that pool and its client, as the Redis backend opens it once for all its parts.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any
from urllib.parse import parse_qs, unquote, urlsplit

import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.asyncio.sentinel import Sentinel, SentinelConnectionPool
from redis.backoff import ExponentialWithJitterBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

SENTINEL_SCHEMES = ("redis+sentinel", "rediss+sentinel")


@dataclass(frozen=True, slots=True)
class SentinelURL:
    sentinels: list[tuple[str, int]]
    service: str
    db: int = 0
    username: str | None = None
    password: str | None = None
    sentinel_password: str | None = None
    ssl: bool = False
    ssl_ca_certs: str | None = None
    extra: dict[str, str] = field(default_factory=dict)


def parse_sentinel(url: str) -> SentinelURL:
    """Parse a ``redis+sentinel://`` URL; ``ValueError`` says what is wrong with it."""
    parts = urlsplit(url)
    if parts.scheme not in SENTINEL_SCHEMES:
        raise ValueError(f"not a Sentinel URL (scheme {parts.scheme!r})")
    creds, _, hosts = parts.netloc.rpartition("@")
    username, _, password = creds.partition(":") if creds else ("", "", "")
    sentinels: list[tuple[str, int]] = []
    for item in filter(None, hosts.split(",")):
        host, _, port = item.rpartition(":")
        if not host or not port.isdigit():
            raise ValueError(f"Sentinel address {item!r} is not host:port")
        sentinels.append((host.strip("[]"), int(port)))
    if not sentinels:
        raise ValueError("a Sentinel URL needs at least one host:port")
    path = [p for p in parts.path.split("/") if p]
    if not path or len(path) > 2:
        raise ValueError("a Sentinel URL's path is /<service>[/<db>]")
    if len(path) == 2 and not path[1].isdigit():
        raise ValueError(f"database {path[1]!r} is not a number")
    query = {k: v[-1] for k, v in parse_qs(parts.query).items()}
    return SentinelURL(
        sentinels=sentinels,
        service=unquote(path[0]),
        db=int(path[1]) if len(path) == 2 else 0,
        username=unquote(username) or None,
        password=unquote(password) or None,
        sentinel_password=query.pop("sentinel_password", None),
        ssl=parts.scheme.startswith("rediss"),
        ssl_ca_certs=query.pop("ssl_ca_certs", None),
        extra=query,
    )


class _BlockingSentinelPool(SentinelConnectionPool, aioredis.BlockingConnectionPool):
    """Sentinel's master discovery with the blocking pool's wait for a free connection."""


def make_pool(url: str, **options: Any) -> aioredis.ConnectionPool:
    """The pool for ``url`` with redis-py connection ``options`` (``max_connections``,
    ``timeout``, socket timeouts, ``retry`` ...)."""
    if not url.startswith(tuple(f"{s}://" for s in SENTINEL_SCHEMES)):
        pool: aioredis.ConnectionPool = aioredis.BlockingConnectionPool.from_url(url, **options)
        return pool
    s = parse_sentinel(url)
    if s.extra:
        raise ValueError(f"unknown Sentinel URL parameter(s): {', '.join(sorted(s.extra))}")
    socket = {k: v for k, v in options.items() if k.startswith("socket_")}
    manager = Sentinel(  # type: ignore[no-untyped-call]
        s.sentinels, sentinel_kwargs={**socket, "password": s.sentinel_password}, **socket
    )
    return _BlockingSentinelPool(  # type: ignore[no-untyped-call]
        s.service,
        manager,
        db=s.db,
        username=s.username,
        password=s.password,
        ssl=s.ssl,
        **({"ssl_ca_certs": s.ssl_ca_certs} if s.ssl_ca_certs else {}),
        **options,
    )


async def close_pool(pool: aioredis.ConnectionPool) -> None:
    """Disconnect the pool, and the connections a Sentinel pool keeps to its Sentinels."""
    await pool.disconnect()
    manager = getattr(pool, "sentinel_manager", None)
    for sentinel in getattr(manager, "sentinels", ()):
        await sentinel.aclose()


class RedisLink:
    """One client and its pool, with the store's retries and timeouts: the connection the Redis
    backend's store, KV index and load board share (``metaserver.backend``). Whoever opened it
    closes it: the store does, at its ``close``."""

    def __init__(
        self,
        url: str,
        *,
        max_connections: int = 64,
        retries: int = 3,
        socket_timeout_s: float = 2.0,
    ) -> None:
        retry = Retry(ExponentialWithJitterBackoff(base=0.02, cap=0.25), retries)
        self.pool = make_pool(
            url,
            max_connections=max_connections,
            timeout=socket_timeout_s,
            socket_timeout=socket_timeout_s,
            socket_connect_timeout=socket_timeout_s,
            retry=retry,
            retry_on_error=[RedisConnectionError, RedisTimeoutError],
            health_check_interval=10,
        )
        self.client = aioredis.Redis(connection_pool=self.pool)

    async def close(self) -> None:
        await self.client.aclose()
        await close_pool(self.pool)
