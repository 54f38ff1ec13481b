"""Wire models of the metaserver's HTTP API (validated once, at the edge).

A *binding* says where the prefill instance must push the KV of one transfer: which decode
instance, its KV endpoint and the block ids it allocated. An *instance* is a vLLM server that
registered itself (and keeps heartbeating) so that bindings may point at it.
"""

from __future__ import annotations

import enum
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from pdwire.ids import ID_BODY, INSTANCE_ID_PATTERN
from pdwire.origin import OriginUrl
from pdwire.version import UNVERSIONED

MAX_KV_GROUPS = 16
MAX_BLOCKS_PER_GROUP = 65_536
MAX_TP_SIZE = 1024

Name = Annotated[str, Field(min_length=1, max_length=256)]
Host = Annotated[str, Field(min_length=1, max_length=255, pattern=r"^[A-Za-z0-9._:\[\]-]+$")]
Port = Annotated[int, Field(ge=1, le=65535)]
BlockId = Annotated[int, Field(ge=0, le=2**31 - 1)]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class BindingState(enum.StrEnum):
    BOUND = "bound"
    PREFILL_STARTED = "prefill_started"
    PUSHING = "pushing"
    DONE = "done"
    FAILED = "failed"
    ABORTED = "aborted"

    @property
    def rank(self) -> int:
        return _RANK[self]

    @property
    def terminal(self) -> bool:
        return _RANK[self] == 3


_RANK = {
    BindingState.BOUND: 0,
    BindingState.PREFILL_STARTED: 1,
    BindingState.PUSHING: 2,
    BindingState.DONE: 3,
    BindingState.FAILED: 3,
    BindingState.ABORTED: 3,
}


class KVEndpoint(_Strict):
    """Where a decode instance's KV side channel listens (rank r uses ``port + r``)."""

    host: Host
    port: Port


class BindingSpec(_Strict):
    """What the decode instance writes when it has allocated blocks for a transfer."""

    request_id: Name = Field(description="vLLM request id on the decode instance")
    decode_instance_id: Annotated[str, Field(pattern=INSTANCE_ID_PATTERN)]
    engine_id: Name
    kv_endpoint: KVEndpoint
    tp_size: Annotated[int, Field(ge=1, le=MAX_TP_SIZE)] = 1
    tp_rank_offset: Annotated[int, Field(ge=0, le=MAX_TP_SIZE * 64)] = Field(
        default=0, description="first global rank of this instance's TP group (dp_rank * tp_size)"
    )
    num_kv_heads: Annotated[int, Field(ge=1, le=4096)] | None = None
    use_mla: bool = False
    block_size: Annotated[int, Field(ge=1, le=4096)]
    block_ids: Annotated[
        list[Annotated[list[BlockId], Field(max_length=MAX_BLOCKS_PER_GROUP)]],
        Field(min_length=1, max_length=MAX_KV_GROUPS),
    ] = Field(description="block ids allocated on D, one list per KV cache group")
    num_cached_tokens: Annotated[int, Field(ge=0)] = Field(
        default=0, description="prompt tokens D already holds (prefix cache); P skips them"
    )
    num_prompt_tokens: Annotated[int, Field(ge=1, le=2**24)]
    protocol: Annotated[int, Field(ge=1, le=1_000_000)] = Field(
        default=UNVERSIONED,
        description="the pdgate protocol version D speaks (pdwire.version); P refuses another",
    )
    load_deadline: Annotated[float, Field(gt=0)] | None = Field(
        default=None,
        description="Unix time after which D stops waiting and recomputes; P must not write "
        "into these blocks after it (minus a clock-skew margin)",
    )

    @model_validator(mode="after")
    def _consistent(self) -> BindingSpec:
        if self.num_cached_tokens > self.num_prompt_tokens:
            raise ValueError("num_cached_tokens cannot exceed num_prompt_tokens")
        needed = -(-self.num_prompt_tokens // self.block_size)
        for group in self.block_ids:
            if len(group) > needed:
                raise ValueError(
                    f"{len(group)} block ids for {self.num_prompt_tokens} tokens "
                    f"at block_size {self.block_size} (at most {needed})"
                )
        return self


class EventDetail(_Strict):
    bytes_pushed: Annotated[int, Field(ge=0)] | None = None
    blocks_pushed: Annotated[int, Field(ge=0)] | None = None
    error: Annotated[str, Field(max_length=4096)] | None = None
    message: Annotated[str, Field(max_length=1024)] | None = None


class EventIn(_Strict):
    state: BindingState
    actor: Annotated[str, Field(min_length=1, max_length=128)]
    detail: EventDetail | None = None


class Event(_Strict):
    state: BindingState
    actor: str
    at: float
    detail: EventDetail | None = None


class MarkKind(enum.StrEnum):
    """Moments of a transfer that are not binding states: the proxy reports them after the
    binding is done (or failed), so they never move the state machine."""

    FIRST_TOKEN = "first_token"  # the proxy got D's first token (or, not streamed, its answer)
    END = "end"  # the proxy finished (or gave up on) the client's answer
    CORRUPT = "corrupt"  # P's first token and D's differed: D's answer was not sent
    MIGRATED = "migrated"  # D broke mid-stream: the answer went on from another pair
    # the proxy gave up on this transfer's KV (outcome failed or aborted, message why): D
    # computed the prompt itself, or the attempt ended; the engines' events move the state
    ABANDONED = "abandoned"


class MarkDetail(_Strict):
    since_request_s: Annotated[float, Field(ge=0, le=86_400)] | None = Field(
        default=None,
        description="seconds from the proxy receiving the client's request to this moment",
    )
    outcome: Annotated[str, Field(max_length=64)] | None = Field(
        default=None,
        description="end: how the answer ended (ok, stream_error, …); corrupt: both first "
        "tokens; abandoned: failed (P failed or pushed nothing) or aborted",
    )
    message: Annotated[str, Field(max_length=1024)] | None = Field(
        default=None, description="abandoned: why the proxy gave up on the transfer's KV"
    )
    chunks: Annotated[int, Field(ge=0, le=100_000_000)] | None = Field(
        default=None,
        description="end of a streamed answer: the body chunks D sent it in since the first "
        "token (vLLM flushes each event: about one per token, then [DONE])",
    )
    kv_held: Annotated[dict[Annotated[str, Field(max_length=128)], int], Field(max_length=256)] | (
        None
    ) = Field(
        default=None,
        description="first_token with the kv policy: the prompt's blocks each candidate held, "
        "by the KV-event index (instance id: blocks), when P and D were chosen",
    )


class MarkIn(_Strict):
    mark: MarkKind
    actor: Annotated[str, Field(min_length=1, max_length=128)]
    detail: MarkDetail | None = None


class Mark(_Strict):
    mark: MarkKind
    actor: str
    at: float
    detail: MarkDetail | None = None


class Binding(BindingSpec):
    """A binding as the metaserver returns it."""

    def differs_from(self, other: BindingSpec) -> str | None:
        """The first field of what D wrote in which ``other`` differs (None: the same
        binding): P pushes only into the binding it took the lease of."""
        for name in BindingSpec.model_fields:
            if getattr(self, name) != getattr(other, name):
                return name
        return None

    transfer_id: str
    state: BindingState
    created_at: float
    updated_at: float
    events: list[Event]
    marks: list[Mark] = Field(
        default_factory=list,
        description="first_token / end, once each; the key is absent while there are none",
    )

    @property
    def claimed(self) -> bool:
        """Whether a prefill instance took this transfer (its compare-and-set ``bound →
        prefill_started`` won). Until P signals D or D's deadline passes, P may be writing into
        D's blocks; a binding that ended unclaimed never had, and never will have, a push."""
        return any(e.state in _PUSH_STATES for e in self.events)


_PUSH_STATES = frozenset({BindingState.PREFILL_STARTED, BindingState.PUSHING, BindingState.DONE})


class InstanceRole(enum.StrEnum):
    PREFILL = "prefill"
    DECODE = "decode"
    BOTH = "both"


Label = Annotated[str, Field(min_length=1, max_length=128, pattern=r"^[A-Za-z0-9._:/+@-]+$")]


class KVIdentity(_Strict):
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


class KVEvents(_Strict):
    """Where an engine publishes vLLM's KV cache events (``--kv-events-config``), and how its
    block hashes are computed; the metaserver's KV-event index follows it
    (``metaserver.kvindex``), the proxy hashes prompts alike (``pdwire.block_hash``)."""

    port: Port = Field(description="the ZeroMQ PUB socket, on the host of the instance's url")
    replay_port: Port | None = Field(default=None, description="the replay (ROUTER) socket")
    topic: Annotated[str, Field(max_length=128)] = ""
    block_size: Annotated[int, Field(ge=1, le=4096)]
    hash_algo: Label = "sha256"


class InstanceSpec(_Strict):
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


class Stats(BaseModel):
    bindings_by_state: dict[str, int]
    bindings_scanned: int
    bound_to_done_ms: dict[str, float | None]
    bound_to_done_samples: int
    instances_by_role: dict[str, int]


KV_MATCH_PATH = "/v1/kv/match"
KV_MATCH_MAX_KEYS = 8192
KV_MATCH_MAX_PRODUCT = 65_536  # keys x distinct instances in one match
BlockKey = Annotated[int, Field(ge=0, le=2**64 - 1)]


class KVMatchIn(_Strict):
    """A prompt's block keys (``pdwire.block_hash``), first block first, and the instances
    to look them up for."""

    keys: Annotated[list[BlockKey], Field(max_length=KV_MATCH_MAX_KEYS)]
    instances: Annotated[list[Annotated[str, Field(pattern=INSTANCE_ID_PATTERN)]], Field(
        min_length=1, max_length=1024
    )]  # fmt: skip
    placed: bool = Field(
        default=True,
        description="count what proxies placed there lately (false: the engines' events only)",
    )

    @model_validator(mode="after")
    def _bounded(self) -> KVMatchIn:
        work = len(self.keys) * len(set(self.instances))
        if work > KV_MATCH_MAX_PRODUCT:
            raise ValueError(
                f"{len(self.keys)} keys x {len(set(self.instances))} instances is over "
                f"{KV_MATCH_MAX_PRODUCT} (keys x instances)"
            )
        return self


class KVMatchOut(BaseModel):
    matched: dict[str, int] = Field(description="per instance: leading keys it holds")


KV_PLACED_PATH = "/v1/kv/placed"
KV_PLACED_MAX = 64  # placements per call


class KVPlacement(_Strict):
    """A prompt's block keys, first block first, and the instance a proxy just sent it to."""

    instance: Annotated[str, Field(pattern=INSTANCE_ID_PATTERN, max_length=128)]
    keys: Annotated[list[BlockKey], Field(min_length=1, max_length=KV_MATCH_MAX_KEYS)]


class KVPlacedIn(_Strict):
    """Prompts proxies just sent: their keys count as held there for a few seconds
    (``metaserver.kvindex.index.PLACED_S``), until the engines' own events say so."""

    placed: Annotated[list[KVPlacement], Field(min_length=1, max_length=KV_PLACED_MAX)]


LOAD_PATH = "/v1/load/{replica}"
Url = Annotated[str, Field(min_length=1, max_length=512)]


class LoadReport(_Strict):
    """One proxy replica's in-flight load per instance url: ``[requests, tokens]`` (P's tokens
    are the uncached ones it computes), the instances whose circuit it has open, and the
    prefill tokens it sent each instance lately (decaying over a minute: the ``kv`` policy's
    ties)."""

    instances: Annotated[dict[Url, tuple[Annotated[int, Field(ge=0, le=1_000_000)], Annotated[
        int, Field(ge=0, le=2**40)]]], Field(max_length=4096)]  # fmt: skip
    open_circuits: Annotated[list[Url], Field(max_length=4096)] = []
    recent: Annotated[dict[Url, Annotated[int, Field(ge=0, le=2**48)]], Field(
        max_length=4096)] = {}  # fmt: skip
    ttl_s: Annotated[float, Field(gt=0, le=60)] = 2.0


class LoadView(BaseModel):
    """What the other replicas reported and have not let expire, summed per instance url."""

    others: dict[str, tuple[int, int]]
    open_circuits: list[str]
    recent: dict[str, int] = {}
    replicas: int = Field(description="replicas reporting, this one included")


BATCH_PATH = "/v1/batch"
BATCH_MAX_CALLS = 256


class BatchCall(_Strict):
    """One write in a batch: the method, path and body its own request would have sent."""

    method: Literal["PUT", "POST"]
    path: Annotated[
        str, Field(max_length=160, pattern=rf"^/v1/bindings/{ID_BODY}(/events|/marks)?$")
    ] = Field(description="PUT /v1/bindings/{id}, POST …/{id}/events or POST …/{id}/marks")
    body: dict[str, Any]


class BatchIn(_Strict):
    """Several binding writes in one request (``POST /v1/batch``). Calls about one transfer run
    in their order; calls about different transfers run side by side."""

    calls: Annotated[list[BatchCall], Field(min_length=1, max_length=BATCH_MAX_CALLS)]


class BatchResult(BaseModel):
    status: int = Field(description="the status the call alone would have been answered with")
    body: Any = Field(description="its answer: a binding, an error's detail; null for 204")


class BatchOut(BaseModel):
    results: list[BatchResult] = Field(description="one per call, in the calls' order")
