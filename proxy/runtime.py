"""Everything one proxy process holds, built from settings and started inside the event loop:
the pooled HTTP session, the instance registry and its discovery / health tasks, policies,
flows, routing and the metaserver client.

One metaserver client (``metaserver``) makes every JSON call — discovery, drains, marks, and,
through ``with_policy``, the routing calls that must not wait (the KV index's match and
placements, the shared load: short timeouts, no retries). D's binding is read on the data path
instead, as raw bytes embedded in P's request unparsed: the long-poll on the legs' HTTP client,
the binding feed on the pooled session (``proxy.flows.bindings``, ``proxy.flows.feed``)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
from typing import TYPE_CHECKING, Any

import aiohttp

from pdwire.ascend import ascend_id_prefixes
from pdwire.client import AsyncMetaserverClient
from pdwire.client.retry import Backoff, RetryPolicy
from pdwire.ids import IdMaker
from proxy.admission import Admission
from proxy.aiohttp_backend import AiohttpBackend
from proxy.backend import Backend
from proxy.canary import Canaries
from proxy.config import Discovery, Flow, HttpClient, ProxySettings
from proxy.events import NO_EVENTS, EventClient, EventSink, NoEvents
from proxy.flows import AscendLayerwise, DecodeFirst, Direct, Legs, PrefillFirst, Timeouts
from proxy.flows.base import Flow as FlowImpl
from proxy.flows.bindings import BindingSource
from proxy.flows.feed import BindingFeed
from proxy.instances import (
    DiscoverySource,
    DnsDiscovery,
    DrainControl,
    DrainWatch,
    HealthChecker,
    MetaserverDiscovery,
    Registry,
    StaticDiscovery,
    refresh,
    run_discovery,
)
from proxy.instances.share import LoadShare, LoadSync
from proxy.integrity import PairGuard
from proxy.metrics import Metrics
from proxy.native import NativeBackend, Pools
from proxy.policies import make_policy
from proxy.policies.prefix import PrefixAware
from proxy.routing import (
    Decider,
    Dispatcher,
    Pairing,
    Policies,
    RouteListener,
    Selector,
    SharedLoad,
)
from proxy.routing.kv import KVAnnotator, KVPlacement
from proxy.routing.select import NO_ANNOTATION, Annotator
from proxy.tracing import ProxyTracer, build_tracer

if TYPE_CHECKING:
    from proxy.kvroute.lookup import KVLookup

log = logging.getLogger("pdgate.proxy")
NO_RETRY = RetryPolicy(retries=0)  # the routing calls: an answer late is an answer useless
SHARE_TIMEOUT_S = 1.0


def replica_name(given: str | None, workers: int) -> str:
    """This process's name in the shared load: each worker process is a replica of its own."""
    if given is None:
        return f"{socket.gethostname()}-{os.getpid()}"[:128]
    return f"{given}-{os.getpid()}" if workers > 1 else given


class Runtime:
    def __init__(self, settings: ProxySettings) -> None:
        self.settings = settings
        self.registry = Registry(
            circuit_failures=settings.circuit_failures, circuit_open_s=settings.circuit_open_s
        )
        self.metrics = Metrics(self.registry.instances)
        self.admission = Admission(settings.max_inflight)
        self.prefill_policy = make_policy(settings.prefill_policy)
        self.decode_policy = make_policy(settings.decode_policy)
        self.api_keys = frozenset(k.get_secret_value().encode() for k in settings.api_keys)
        # never the API keys: any client could then drain the whole fleet
        self.admin_keys = frozenset(k.get_secret_value().encode() for k in settings.admin_keys)
        self.drains = DrainControl(self.registry, None)  # local drains until ``start``
        self.session: aiohttp.ClientSession | None = None
        self.metaserver: AsyncMetaserverClient | None = None
        self.events: EventSink | NoEvents = NO_EVENTS  # marks need a metaserver
        self.dispatcher: Dispatcher | None = None
        self.backend: Backend | None = None
        # tracing on: built by ``start`` in the serving process (tests may set one); None: off
        self.tracer: ProxyTracer | None = None
        self._tasks: list[asyncio.Task[Any]] = []
        self.ids = IdMaker("pd")  # transfer ids; the binding feed asks for this prefix
        self.bindings: BindingSource | None = None
        self.canaries: Canaries | None = None  # wired with --canary-interval > 0
        self.kv: KVLookup | None = None  # the kv policy's index lookups (built by ``start``)
        self.share: LoadSync | None = None  # --share-load (built by ``start``)

    async def start(self) -> None:
        s = self.settings
        if self.tracer is None:
            self.tracer = build_tracer(s)
        connector = aiohttp.TCPConnector(
            limit=s.max_connections, limit_per_host=0, ttl_dns_cache=60,
            keepalive_timeout=s.keepalive_s,
        )  # fmt: skip
        self.session = aiohttp.ClientSession(
            connector=connector, auto_decompress=False, cookie_jar=aiohttp.DummyCookieJar()
        )
        token = s.metaserver_token.get_secret_value() if s.metaserver_token else None
        if s.metaserver:
            self.metaserver = AsyncMetaserverClient(s.metaserver, token=token, session=self.session)
        auth = s.engine_authorization
        backend: Backend = AiohttpBackend(
            self.session, connect_timeout_s=s.connect_timeout_s,
            idle_timeout_s=s.idle_timeout_s, authorization=auth,
        )  # fmt: skip
        if s.http_client == HttpClient.NATIVE:
            pools = Pools(
                connect_timeout_s=s.connect_timeout_s,
                keepalive_s=s.keepalive_s,
                max_idle_per_origin=s.max_connections,
            )
            backend = NativeBackend(
                pools, idle_timeout_s=s.idle_timeout_s, fallback=backend, authorization=auth
            )
        if s.kv_routing and self.kv is None:
            assert s.tokenizer is not None and self.metaserver is not None and s.metaserver
            from proxy.kvroute.lookup import MATCH_TIMEOUT_S, KVLookup
            from proxy.kvroute.tokens import HFTokenizer

            tok = await asyncio.to_thread(HFTokenizer, s.tokenizer)
            matcher = self.metaserver.with_policy(timeout_s=MATCH_TIMEOUT_S, retry=NO_RETRY)
            self.kv = KVLookup(tok, matcher, s.kv_hash_seed, self.metrics.kv_lookups.labels)
        share: LoadShare | None = None
        if s.share_load and self.share is None:
            assert self.metaserver is not None
            exchange = self.metaserver.with_policy(timeout_s=SHARE_TIMEOUT_S, retry=NO_RETRY)
            name = replica_name(s.replica_id, s.workers)
            self.share = share = LoadShare(self.registry, exchange, name, s.share_interval_s)
        self.wire(backend, self.metaserver)
        source = self._discovery_source()
        try:
            await refresh(source, self.registry)
        except Exception as exc:
            log.warning("first discovery poll failed (will retry): %s", exc)
        loop = asyncio.get_running_loop()
        if s.discovery != Discovery.STATIC:
            self._tasks.append(
                loop.create_task(run_discovery(source, self.registry, s.discovery_interval_s))
            )
        if self.bindings is not None and s.binding_feed:
            assert s.metaserver is not None
            # the proxy's own transfer ids, and vllm-ascend D's request ids made of them
            prefixes = (self.ids.prefix, *ascend_id_prefixes(self.ids.prefix))
            feed = BindingFeed(self.session, s.metaserver, token, prefixes)
            self.bindings.feed = feed
            self._tasks.append(loop.create_task(feed.run(), name="binding-feed"))
        if self.metaserver is not None:
            self.drains = DrainControl(self.registry, self.metaserver)
            watch = DrainWatch(self.metaserver, self.registry)
            try:
                await watch.poll()
            except Exception as exc:
                log.warning("first registry poll for drains failed (will retry): %s", exc)
            self._tasks.append(loop.create_task(watch.run(s.discovery_interval_s)))
        if share is not None:
            self._tasks.append(loop.create_task(share.run(), name="load-share"))
        checker = HealthChecker(self.registry, self.session, interval_s=s.health_interval_s)
        self._tasks.append(loop.create_task(checker.run()))
        if self.canaries is not None:
            self._tasks.append(loop.create_task(self.canaries.run(), name="canaries"))

    def wire(self, backend: Backend, events: EventClient | None) -> None:
        """Build the data path on ``backend``: legs, flows, dispatcher; the decode-first flows
        when ``events`` (the metaserver client) is given. ``start`` wires the real HTTP client;
        tests can wire ``tests.proxy.mock.MockBackend`` into a runtime that is never started."""
        s = self.settings
        self.backend = backend
        timeouts = Timeouts(
            s.prefill_timeout_s,
            s.binding_wait_s,
            s.first_token_timeout_s,
            s.request_timeout_s,
            s.prefill_grace_s,
        )
        guard = PairGuard(s.pair_quarantine_s, self.metrics) if s.first_token_check else None
        pairing = Pairing(guard)
        legs = Legs(backend, timeouts, self.metrics, guard)
        flows: dict[Flow, FlowImpl] = {
            Flow.DIRECT: Direct(legs),
            Flow.PREFILL_FIRST: PrefillFirst(legs),
        }
        if events is not None:
            assert s.metaserver is not None
            token = s.metaserver_token.get_secret_value() if s.metaserver_token else None
            sink = self.events = EventSink(events)
            bindings = self.bindings = BindingSource(backend, s.metaserver, token, self.metrics)
            flows[Flow.DECODE_FIRST] = DecodeFirst(legs, bindings, sink)
            flows[Flow.CONCURRENT] = DecodeFirst(legs, bindings, sink, concurrent=True)
            flows[Flow.ASCEND_LAYERWISE] = AscendLayerwise(legs, bindings, sink, s.ascend_urls())
        canary_flow = flows.get(s.flow)
        if guard is not None and s.canary_interval_s > 0 and canary_flow is not None:
            if canary_flow.needs_prefill:
                self.canaries = Canaries(
                    self.registry, canary_flow, guard, pairing, self.metrics, self.ids,
                    s.canary_interval_s,
                )  # fmt: skip
        prefix = self.decode_policy if isinstance(self.decode_policy, PrefixAware) else None
        decider = Decider(s.disagg_min_tokens, s.cached_skip_ratio, prefix, self.metrics)
        annotator: Annotator = NO_ANNOTATION
        listeners: list[RouteListener] = []
        if self.kv is not None:  # first: its ``choosing`` never waits
            annotator = KVAnnotator(self.kv, self.registry)
            listeners.append(KVPlacement(self.kv))
        if self.share is not None:
            listeners.append(SharedLoad(self.share))
        policies = Policies(self.prefill_policy, self.decode_policy)
        selector = Selector(
            self.registry, flows, policies, decider, pairing, self.metrics, annotator
        )
        self.dispatcher = Dispatcher(
            selector,
            listeners,
            self.metrics,
            retries=s.retries,
            backoff=Backoff(base=s.backoff_base_s, cap=s.backoff_cap_s),
            ids=self.ids,
        )

    def _discovery_source(self) -> DiscoverySource:
        s = self.settings
        if s.discovery == Discovery.METASERVER:
            assert self.metaserver is not None
            return MetaserverDiscovery(self.metaserver)
        if s.discovery == Discovery.DNS:
            assert s.prefill_dns and s.decode_dns
            return DnsDiscovery(s.prefill_dns, s.decode_dns)
        return StaticDiscovery(s.prefill, s.decode)

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        await self.events.drain()
        if self.kv is not None:
            self.kv.close()
        if self.backend is not None:
            await self.backend.close()
        if self.session is not None:
            await self.session.close()
        if self.tracer is not None:
            await asyncio.to_thread(self.tracer.shutdown)  # flushes queued spans
