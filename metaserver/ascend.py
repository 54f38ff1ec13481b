"""vllm-ascend compatibility: the URL unchanged ``MooncakeLayerwiseConnector`` decode engines POST
their blocks to (``POST /v1/ascend/metaserver``).

The body (``pdwire.ascend.AscendBinding``) is validated, its ``remote_host:remote_port`` checked
against the decode pool this deployment knows, and it is stored as a binding under D's request
id, the way ``PUT /v1/bindings/{id}`` stores pdgate's own. The answer comes at once: D's
scheduler thread is never held for the prefill (the example proxy held it until P finished).

The decode pool (``DecodeEndpoints``): ``--ascend-decode HOST:PORT[-PORT]`` entries, HOST an
address or a DNS name (a headless Service: every address it resolves to), re-resolved every few
seconds; plus, unless ``--no-ascend-registry``, the KV endpoints of registered decode instances.
A binding naming anything else is refused (422): whoever can reach this URL must not be able to
send P's KV push elsewhere. D sends no Authorization header: where the metaserver needs
credentials, the URL carries ``?rid=<X-Request-Id>&cap=<capability>`` (``pdwire.ascend.capability``,
keyed with a proxy's token; the proxy builds such URLs), good for that request's bindings alone.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import re
import socket
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from urllib.parse import parse_qs

from metaserver.context import Context
from metaserver.errors import Forbidden, Unauthorized, Unprocessable
from metaserver.service import Reply
from metaserver.store import Store
from metaserver.store.base import BindingPut, PutOutcome, event_json
from metaserver.validation import parse_body
from pdwire.ascend import AscendBinding, x_request_id_of
from pdwire.ids import valid_id
from pdwire.models import BindingState, InstanceSpec

log = logging.getLogger("pdgate.metaserver.ascend")
_HOST = re.compile(r"[A-Za-z0-9._:-]{1,255}")
Resolver = Callable[[str], Awaitable[list[str]]]


@dataclass(frozen=True, slots=True)
class PoolEntry:
    host: str
    first_port: int
    last_port: int

    @classmethod
    def parse(cls, text: str) -> PoolEntry:
        host, sep, ports = text.strip().rpartition(":")
        host = host.strip("[]")
        first, _, last = ports.partition("-")
        bad_host = not host or not _HOST.fullmatch(host)
        if not sep or bad_host or not first.isdigit() or (last and not last.isdigit()):
            raise ValueError(f"{text!r}: expected HOST:PORT or HOST:PORT-PORT")
        lo, hi = int(first), int(last or first)
        if not 1 <= lo <= hi <= 65535:
            raise ValueError(f"{text!r}: ports must satisfy 1 <= first <= last <= 65535")
        return cls(host, lo, hi)


def _is_address(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


async def resolve_host(name: str) -> list[str]:
    infos = await asyncio.get_running_loop().getaddrinfo(name, None, type=socket.SOCK_STREAM)
    return sorted({str(info[4][0]) for info in infos})


class DecodeEndpoints:
    """Whether ``host:port`` belongs to the decode pool; lookups refreshed every ``refresh_s``."""

    def __init__(
        self,
        entries: Sequence[str],
        store: Store,
        *,
        use_registry: bool = True,
        refresh_s: float = 5.0,
        resolve: Resolver = resolve_host,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._entries = [PoolEntry.parse(e) for e in entries]
        self._store = store
        self._use_registry = use_registry
        self._refresh_s = refresh_s
        self._resolve = resolve
        self._clock = clock
        self._addresses: dict[str, list[str]] = {}  # entry host → its addresses
        self._registered: set[tuple[str, int]] = set()
        self._next_dns = self._next_registry = 0.0
        self._lock = asyncio.Lock()

    @property
    def configured(self) -> bool:
        return bool(self._entries) or self._use_registry

    async def problem(self, host: str, port: int) -> str | None:
        """``None`` when the pool holds ``host:port``; else why the binding is refused."""
        host = host.strip("[]")
        if self._static_match(host, port):
            return None
        await self._refresh()
        if self._static_match(host, port) or (host, port) in self._registered:
            return None
        if not self.configured:
            return "no decode pool is configured (--ascend-decode): every binding is refused"
        return f"{host}:{port} is not a KV endpoint of a known decode instance"

    def _static_match(self, host: str, port: int) -> bool:
        for e in self._entries:
            if e.first_port <= port <= e.last_port:
                if host == e.host or host in self._addresses.get(e.host, ()):
                    return True
        return False

    async def _refresh(self) -> None:
        now = self._clock()
        if now < self._next_dns and (not self._use_registry or now < self._next_registry):
            return
        async with self._lock:
            now = self._clock()
            if now >= self._next_dns:
                self._next_dns = now + self._refresh_s
                await self._refresh_dns()
            if self._use_registry and now >= self._next_registry:
                self._next_registry = now + self._refresh_s
                await self._refresh_registry()

    async def _refresh_dns(self) -> None:
        for name in {e.host for e in self._entries if not _is_address(e.host)}:
            try:
                self._addresses[name] = await self._resolve(name)
            except OSError as exc:  # keep what the last lookup found
                log.warning("decode pool: cannot resolve %s: %s", name, exc)

    async def _refresh_registry(self) -> None:
        found: set[tuple[str, int]] = set()
        for role in ("decode", "both"):
            for inst in await self._store.list_instances(role):
                kv = InstanceSpec.model_validate_json(inst.spec_json).kv_endpoint
                if kv is not None:
                    found.add((kv.host, kv.port))
        self._registered = found


@dataclass(frozen=True, slots=True)
class Grant:
    """What the caller of the compat endpoint may bind: any request (a header credential, or
    no credentials needed), or only D requests made from one ``X-Request-Id``."""

    x_request_id: str | None = None


_warned: list[bool] = []


async def authorize(c: Context, header: bytes | None, query: bytes) -> Grant:
    """``?rid=&cap=`` (D's connector cannot send a header), else an admin's Authorization."""
    assert c.access is not None
    if c.access.open:
        return Grant()
    values = parse_qs(query.decode("latin-1"))
    rid, cap = values.get("rid"), values.get("cap")
    if rid and cap:
        if c.access.capability_ok(rid[0], cap[0]):
            return Grant(rid[0])
        raise Unauthorized("wrong capability in ?cap=")
    legacy = values.get("token")  # what proxies before capabilities sent (single-token mode)
    if legacy and c.access.mode == "single token":
        if not c.access.token_ok(legacy[0]):
            raise Unauthorized("wrong token in ?token=")
        if not _warned:
            _warned.append(True)
            log.warning(
                "a proxy sent the metaserver token in ?token=: upgrade it (it now sends "
                "a per-request capability); this form goes in the next release"
            )
        return Grant()
    who = await c.authorize(header, write=True)
    who.may_administer("post vllm-ascend blocks without a capability")
    return Grant()


async def post_binding(c: Context, grant: Grant, body: bytes) -> Reply:
    """Validate, vet, store; ``{"status": "ok", ...}`` at once (D ignores the answer)."""
    assert c.ascend is not None
    spec = parse_body(AscendBinding, body)
    if grant.x_request_id is not None and x_request_id_of(spec.request_id) != grant.x_request_id:
        raise Forbidden(
            f"the capability is for X-Request-Id {grant.x_request_id!r}, not for "
            f"request {spec.request_id!r}"
        )
    why = await c.ascend.problem(spec.remote_host, spec.remote_port)
    if why is not None:
        c.metrics.ascend_refused.inc()
        raise Unprocessable(why)
    now = c.clock()
    instance = spec.remote_engine_id if valid_id(spec.remote_engine_id) else "ascend-decode"
    put = BindingPut(
        transfer_id=spec.request_id,
        spec_json=spec.model_dump_json().encode(),
        decode_instance_id=instance,
        kv_host=spec.remote_host,
        kv_port=spec.remote_port,
        event_json=event_json(BindingState.BOUND, f"decode:{instance}", now, None),
        vetted=True,
    )
    outcome, _ = await c.store.put_binding(put, now)
    created = outcome is PutOutcome.CREATED
    if created:
        c.metrics.bindings_created.inc()
    tail = b'","created":true}' if created else b'","created":false}'
    return Reply(200, b'{"status":"ok","request_id":"' + spec.request_id.encode() + tail)
