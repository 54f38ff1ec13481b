"""Instances: the vLLM servers that registered with the metaserver (and keep heartbeating), so
that bindings may point at them.

An ``InstanceSpec`` is what an engine (or the proxy, for engines without pdgate's connector)
registers: its role, URL, KV side-channel endpoint, and the identity P and D must share for
P's KV to be D's; an ``Instance`` is the record the metaserver returns.
"""

from __future__ import annotations

import enum
from typing import Annotated

from pydantic import ConfigDict, Field

from pdwire.fields import MAX_TP_SIZE, Host, Label, Port, Strict
from pdwire.origin import OriginUrl


class KVEndpoint(Strict):
    """Where a decode instance's KV side channel listens (rank r uses ``port + r``)."""

    host: Host
    port: Port


class InstanceRole(enum.StrEnum):
    PREFILL = "prefill"
    DECODE = "decode"
    BOTH = "both"


class KVIdentity(Strict):
    """What must be equal on P and D for P's KV to be D's: the weights and config actually
    loaded, and the shape of the KV cache (``pdwire.compat.identity_problem`` compares)."""

    model: Annotated[str, Field(min_length=8, max_length=128, pattern=r"^[A-Za-z0-9:._-]+$")] = (
        Field(
            description="fingerprint of the weights and config the engine loaded "
            "('sha256:…' of config.json and every weight file's header and first bytes)"
        )
    )
    dtype: Label
    kv_cache_dtype: Label
    block_size: Annotated[int, Field(ge=1, le=4096)]
    head_size: Annotated[int, Field(ge=1, le=65_536)]
    num_kv_heads: Annotated[int, Field(ge=1, le=4096)] = Field(description="total, all ranks")
    num_layers: Annotated[int, Field(ge=1, le=100_000)]
    use_mla: bool = False
    protocol: Annotated[int, Field(ge=1, le=1_000_000)]


class KVEvents(Strict):
    """Where an engine publishes vLLM's KV cache events (``--kv-events-config``), and how its
    block hashes are computed; the metaserver's KV-event index follows it
    (``metaserver.kvindex``), the proxy hashes prompts alike (``pdwire.block_hash``)."""

    port: Port = Field(description="the ZeroMQ PUB socket, on the host of the instance's url")
    replay_port: Port | None = Field(default=None, description="the replay (ROUTER) socket")
    topic: Annotated[str, Field(max_length=128)] = ""
    block_size: Annotated[int, Field(ge=1, le=4096)]
    hash_algo: Label = "sha256"


class InstanceSpec(Strict):
    role: InstanceRole
    url: OriginUrl = Field(description="scheme://host:port, nothing else (pdwire.origin)")
    kv_endpoint: KVEndpoint | None = None
    model: Annotated[str, Field(max_length=512)] | None = None
    tp_size: Annotated[int, Field(ge=1, le=MAX_TP_SIZE)] = 1
    version: Annotated[str, Field(max_length=128)] | None = None
    revision: Label | None = Field(
        default=None,
        description="the deployment's revision (a rolling update's old and new pods differ): "
        "a P and a D of different revisions are never paired",
    )
    kv: KVIdentity | None = Field(
        default=None, description="the KV-compatibility identity (engines with pdgate's connector)"
    )
    ttl_s: Annotated[float, Field(gt=0, le=86_400)] | None = Field(
        default=None, description="heartbeat TTL; the server default when omitted"
    )
    kv_events: KVEvents | None = Field(
        default=None, description="the engine publishes KV cache events (prefix-cache routing)"
    )


# InstanceSpec fields added since the first release: the metaserver stores them only when set,
# so that readers from before them keep parsing the records of instances that do not send them
LATER_FIELDS = ("revision", "kv", "kv_events")


class Instance(InstanceSpec):
    """An instance as the metaserver returns it: its spec, times, and whether it is drained.
    Fields this reader does not know (a newer metaserver's or engine's) are ignored."""

    model_config = ConfigDict(extra="ignore", frozen=True)

    instance_id: str
    registered_at: float
    last_heartbeat: float
    expires_at: float
    draining: bool = Field(
        default=False,
        description="set by PUT /v1/instances/{id}/drain (kept across heartbeats): proxies "
        "send this instance no new requests",
    )
