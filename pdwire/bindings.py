"""Bindings: where the prefill instance must push the KV of one transfer, and what happened to it.

D writes a ``BindingSpec`` once it has allocated blocks for a transfer: which decode instance,
its KV endpoint and the block ids. The engines then move the binding through its states with
events (``EventIn``: ``bound → prefill_started → pushing → done``, or ``failed`` / ``aborted``);
the proxy adds marks (``MarkIn``), moments that never move the state. A ``Binding`` is the
record the metaserver returns, with both.
"""

from __future__ import annotations

import enum
from typing import Annotated

from pydantic import BaseModel, Field, model_validator

from pdwire.fields import MAX_BLOCKS_PER_GROUP, MAX_KV_GROUPS, MAX_TP_SIZE, BlockId, Name, Strict
from pdwire.ids import INSTANCE_ID_PATTERN
from pdwire.instances import KVEndpoint
from pdwire.version import UNVERSIONED


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


class BindingSpec(Strict):
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


class EventDetail(Strict):
    bytes_pushed: Annotated[int, Field(ge=0)] | None = None
    blocks_pushed: Annotated[int, Field(ge=0)] | None = None
    error: Annotated[str, Field(max_length=4096)] | None = None
    message: Annotated[str, Field(max_length=1024)] | None = None


class EventIn(Strict):
    state: BindingState
    actor: Annotated[str, Field(min_length=1, max_length=128)]
    detail: EventDetail | None = None


class Event(Strict):
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


class MarkDetail(Strict):
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


class MarkIn(Strict):
    mark: MarkKind
    actor: Annotated[str, Field(min_length=1, max_length=128)]
    detail: MarkDetail | None = None


class Mark(Strict):
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


class Stats(BaseModel):
    bindings_by_state: dict[str, int]
    bindings_scanned: int
    bound_to_done_ms: dict[str, float | None]
    bound_to_done_samples: int
    instances_by_role: dict[str, int]
