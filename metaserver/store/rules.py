"""The rules every store enforces atomically, whatever its backend: whose step a state change
is (``owner_problem``), which changes are legal (``check_transition``), and which decode instance a
binding may name (``decode_instance_problem``)."""

from __future__ import annotations

from metaserver.errors import Conflict, Forbidden
from metaserver.store.records import BindingPut, EventPut
from pdwire.models import BindingState


def owner_problem(
    put: EventPut, state: BindingState, decode: str, holder: str | None, actor_role: str | None
) -> Conflict | Forbidden | None:
    """Whose step ``put`` is, on a binding in ``state`` naming ``decode``, whose lease
    ``holder`` took (``None``: nobody yet). P's lease (``prefill_started``) is exclusive in every
    access mode: a second claimant gets 409. An engine's other steps are its own: ``pushing`` and
    ``done`` the holder's, ``failed`` the holder's or the decode's, ``aborted`` the decode's; and
    only a registered prefill (or both-role) instance takes a lease. ``actor_role``: the actor's
    registered role, ``None`` when it is not registered."""
    actor = put.actor
    if put.state is BindingState.PREFILL_STARTED:
        if holder not in (None, actor) or (holder is None and state is not BindingState.BOUND):
            return taken(put, holder)
        if put.engine and actor_role not in ("prefill", "both"):
            return not_prefill(put)
        return None
    if not put.engine:
        return None
    unknown = holder is None and state is not BindingState.BOUND  # taken before holders were kept
    mine = actor == holder or unknown
    allowed = {
        BindingState.PUSHING: mine,
        BindingState.DONE: mine,
        BindingState.FAILED: mine or actor == decode,
        BindingState.ABORTED: actor == decode,
    }.get(put.state, False)
    return None if allowed else not_its_step(put)


def taken(put: EventPut, holder: str | None) -> Conflict:
    return Conflict(f"binding {put.transfer_id} was taken by {holder or 'another prefill'}")


def not_prefill(put: EventPut) -> Forbidden:
    return Forbidden(f"{put.actor!r} is not a registered prefill instance: it takes no lease")


def not_its_step(put: EventPut) -> Forbidden:
    what = f"{put.state.value} on binding {put.transfer_id}"
    return Forbidden(f"{put.actor!r} may not post {what}: not its step")


def check_transition(current: BindingState, new: BindingState) -> str:
    """Return ``"apply"``, ``"duplicate"`` or ``"conflict"`` for a state change.

    States only move forward (bound → prefill_started → pushing → done|failed|aborted, steps may
    be skipped); ``pushing`` may repeat to report progress; re-sending the current state is an
    idempotent duplicate; nothing leaves a terminal state.
    """
    if current.terminal:
        return "duplicate" if new is current else "conflict"
    if new is current:
        return "apply" if new is BindingState.PUSHING else "duplicate"
    return "apply" if new.rank > current.rank else "conflict"


def decode_instance_problem(
    put: BindingPut, found: tuple[str, tuple[str, int] | None] | None
) -> str | None:
    """The one rule both stores enforce: a binding may only point at a live, registered decode
    instance, at the KV endpoint that instance registered. This is what stops KV from being
    pushed to an address chosen by whoever writes the binding."""
    if found is None:
        return f"decode instance {put.decode_instance_id!r} is not registered (or its TTL lapsed)"
    role, kv = found
    if role == "prefill":
        return f"instance {put.decode_instance_id!r} is registered as prefill-only"
    if kv is None:
        return f"instance {put.decode_instance_id!r} registered no kv_endpoint"
    if kv != (put.kv_host, put.kv_port):
        return (
            f"kv_endpoint {put.kv_host}:{put.kv_port} does not match the one instance "
            f"{put.decode_instance_id!r} registered ({kv[0]}:{kv[1]})"
        )
    return None
