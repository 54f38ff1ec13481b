"""The store's records and requests: what a binding and an instance are once stored (kept as
pre-serialised JSON pieces, so a read never re-encodes: a binding is its canonical spec JSON as
validated at the edge, plus state, times, events and marks), the validated writes the HTTP layer
hands a store, and the summaries it reads back (stats, open transfers)."""

from __future__ import annotations

import enum
import json
from collections.abc import Iterable
from dataclasses import dataclass

from pdwire.models import BindingSpec, BindingState, InstanceSpec, MarkKind

# Past this many events, consecutive ``pushing`` events are folded into the last one.
MAX_EVENTS = 64


class PutOutcome(enum.Enum):
    CREATED = "created"
    SAME = "same"


@dataclass(frozen=True, slots=True)
class StoredBinding:
    transfer_id: str
    spec_json: bytes
    state: BindingState
    decode_instance_id: str
    created_at: float
    updated_at: float
    events: tuple[bytes, ...]
    marks: tuple[bytes, ...] = ()  # in ``MarkKind`` order, each kind at most once

    def to_json(self) -> bytes:
        head = (
            f'{{"transfer_id":"{self.transfer_id}","state":"{self.state.value}",'
            f'"created_at":{self.created_at!r},"updated_at":{self.updated_at!r},'
        ).encode()
        body = head + self.spec_json[1:-1] + b',"events":[' + b",".join(self.events) + b"]"
        if self.marks:  # absent while empty: a reader of an older release rejects the key
            body += b',"marks":[' + b",".join(self.marks) + b"]"
        return body + b"}"


@dataclass(frozen=True, slots=True)
class StoredInstance:
    instance_id: str
    spec_json: bytes
    role: str
    registered_at: float
    last_heartbeat: float
    expires_at: float
    draining: bool = False  # kept across heartbeats; forgotten with the registration

    def to_json(self) -> bytes:
        head = (
            f'{{"instance_id":"{self.instance_id}","registered_at":{self.registered_at!r},'
            f'"last_heartbeat":{self.last_heartbeat!r},"expires_at":{self.expires_at!r},'
            f'"draining":{"true" if self.draining else "false"},'
        ).encode()
        return head + self.spec_json[1:-1] + b"}"


@dataclass(frozen=True, slots=True)
class BindingPut:
    """A validated PUT, with the fields the store must check atomically."""

    transfer_id: str
    spec_json: bytes
    decode_instance_id: str
    kv_host: str
    kv_port: int
    event_json: bytes
    vetted: bool = False  # the caller already checked the decode endpoint (ascend compat)

    @classmethod
    def of(cls, transfer_id: str, spec: BindingSpec, now: float) -> BindingPut:
        return cls(
            transfer_id=transfer_id,
            spec_json=spec.model_dump_json().encode(),
            decode_instance_id=spec.decode_instance_id,
            kv_host=spec.kv_endpoint.host,
            kv_port=spec.kv_endpoint.port,
            event_json=event_json(BindingState.BOUND, spec.decode_instance_id, now, None),
        )


@dataclass(frozen=True, slots=True)
class EventPut:
    """A validated state change, with who posts it: the store checks atomically that the step
    is the actor's to take (``owner_problem``)."""

    transfer_id: str
    state: BindingState
    actor: str
    event_json: bytes
    engine: bool = False  # an engine credential posts it: the actor must own the step


@dataclass(frozen=True, slots=True)
class InstancePut:
    """A validated registration (or heartbeat), with what the store checks atomically: no other
    live instance has this URL or KV endpoint, and the registering credential (``owner``) holds
    at most ``max_owned`` live instances."""

    instance_id: str
    spec_json: bytes
    role: str
    url: str
    kv: tuple[str, int] | None
    ttl_s: float
    owner: str = ""  # the credential's name ('' : not counted, as for an admin)
    max_owned: int = 0  # 0: no cap

    @classmethod
    def of(
        cls, instance_id: str, spec: InstanceSpec, ttl_s: float, owner: str = "",
        max_owned: int = 0, spec_json: bytes | None = None,
    ) -> InstancePut:  # fmt: skip
        kv = None if spec.kv_endpoint is None else (spec.kv_endpoint.host, spec.kv_endpoint.port)
        body = spec.model_dump_json().encode() if spec_json is None else spec_json
        return cls(instance_id, body, spec.role.value, spec.url, kv, ttl_s, owner, max_owned)


@dataclass(frozen=True, slots=True)
class StoreStats:
    by_state: dict[str, int]
    scanned: int
    done_latencies_s: list[float]
    instances_by_role: dict[str, int]


@dataclass(frozen=True, slots=True)
class OpenTransfers:
    """Bindings not in a terminal state yet, among the newest ``scan_limit``."""

    by_state: dict[str, int]
    oldest_created_at: float | None  # None: none open


def open_transfers_of(pairs: Iterable[tuple[str, float]]) -> OpenTransfers:
    """From (state, created_at) of each scanned binding."""
    by_state: dict[str, int] = {}
    oldest: float | None = None
    for state, created in pairs:
        if BindingState(state).terminal:
            continue
        by_state[state] = by_state.get(state, 0) + 1
        oldest = created if oldest is None else min(oldest, created)
    return OpenTransfers(by_state, oldest)


def event_json(state: BindingState, actor: str, at: float, detail_json: bytes | None) -> bytes:
    body = f'{{"state":"{state.value}","actor":{json.dumps(actor)},"at":{at!r},"detail":'
    return body.encode() + (detail_json or b"null") + b"}"


def mark_json(kind: MarkKind, actor: str, at: float, detail_json: bytes | None) -> bytes:
    body = f'{{"mark":"{kind.value}","actor":{json.dumps(actor)},"at":{at!r},"detail":'
    return body.encode() + (detail_json or b"null") + b"}"
