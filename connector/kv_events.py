"""What an engine tells the registry about its KV cache events (``InstanceSpec.kv_events``).

vLLM binds its publisher when the endpoint has ``*`` or ``::`` in it (``tcp://*:5557``, or an
IPv6 address: pd-launch names an IPv4 host as ``tcp://[::ffff:127.0.0.1]:5557`` so that vLLM
binds it and ZeroMQ listens there alone) and connects elsewhere (to a relay); only a bound
publisher can be followed, on the instance's own host.
Data-parallel ranks publish on ``port + rank``.
"""

from __future__ import annotations

import logging

from vllm.config import VllmConfig

from pdwire.models import KVEvents

log = logging.getLogger("pdgate.connector")


def _bound_port(endpoint: str | None, rank: int, *, wildcard: bool = True) -> int | None:
    """The port of a tcp endpoint vLLM binds (``wildcard``: the PUB socket binds only for
    ``*`` or ``::``, as vLLM's ``ZmqEventPublisher._is_bind_endpoint`` decides)."""
    if not endpoint or not endpoint.startswith("tcp://"):
        return None
    if wildcard and "*" not in endpoint and "::" not in endpoint:
        return None
    port = int(endpoint.rsplit(":", 1)[1])
    return port + rank if port else None


def kv_events_of(vllm_config: VllmConfig) -> KVEvents | None:
    cfg = vllm_config.kv_events_config
    cache = vllm_config.cache_config
    if cfg is None or not cfg.enable_kv_cache_events or cfg.publisher != "zmq":
        return None
    if not cache.enable_prefix_caching:
        return None
    rank = vllm_config.parallel_config.data_parallel_rank
    port = _bound_port(cfg.endpoint, rank)
    if port is None:
        log.warning(
            "KV events at %s are not followed: the metaserver follows a publisher bound on the "
            "engine's host ('tcp://*:PORT' or an IPv6 address, port not 0)", cfg.endpoint,
        )  # fmt: skip
        return None
    return KVEvents(
        port=port,
        replay_port=_bound_port(cfg.replay_endpoint, rank, wildcard=False),  # always bound
        topic=cfg.topic,
        block_size=cache.block_size,
        hash_algo=str(cache.prefix_caching_hash_algo),
    )
