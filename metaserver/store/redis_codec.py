"""The Redis store's replies read back into records: a binding from its script's reply (spec,
state, times, marks, events), an instance from its hash, a creation from its ``<ns>:created``
message."""

from __future__ import annotations

from typing import Any

from metaserver.store.records import StoredBinding, StoredInstance
from pdwire.models import BindingState, MarkKind

INSTANCE_FIELDS = ["spec", "role", "reg", "hb", "exp", "drain"]
_MARKS = len(MarkKind)


def created_of(data: bytes) -> StoredBinding:
    """A ``<ns>:created`` message (PUT_BINDING): id, instance, time, first event, spec."""
    tid, inst, created, event, spec = data.split(b"\n", 4)
    at = float(created)
    return StoredBinding(tid.decode(), spec, BindingState.BOUND, inst.decode(), at, at, (event,))


def binding_of(transfer_id: str, res: list[Any]) -> StoredBinding:
    """A binding script's reply: status, spec, state, instance, times, one slot per mark kind,
    then the events (``redis_scripts``)."""
    _, spec, state, inst, created, updated, *rest = res
    marks = tuple(m for m in rest[:_MARKS] if m is not None)
    events = rest[_MARKS:]
    return StoredBinding(
        transfer_id=transfer_id,
        spec_json=spec,
        state=BindingState(state.decode()),
        decode_instance_id=inst.decode(),
        created_at=float(created),
        updated_at=float(updated),
        events=tuple(events),
        marks=marks,
    )


def instance_of(instance_id: str, h: list[Any]) -> StoredInstance | None:
    """An instance hash's ``INSTANCE_FIELDS``; ``None`` when it is gone."""
    spec, role, reg, hb, exp, drain = h
    if spec is None:
        return None
    return StoredInstance(
        instance_id, spec, role.decode(), float(reg), float(hb), float(exp), bool(drain)
    )
