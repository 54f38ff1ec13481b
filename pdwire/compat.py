"""Which prefill and decode instances can be paired: the rules every part checks alike.

A P instance can push into a D instance only when P's KV heads map onto D's ranks. Rank ``r``
of a TP group of size ``tp`` holds KV heads ``[r*H/tp, (r+1)*H/tp)`` when ``tp <= H``; when
``tp > H`` heads are replicated and rank r holds head ``r // (tp/H)`` (vLLM's split). MLA
caches have one latent "head" that every rank holds. P tp and D tp may differ in either
direction, as long as one divides the other and each is a split vLLM can make.

The connector (P's refusal of a binding, its per-rank routes), pd-launch, the Helm chart's
tests and the documentation's topologies all ask ``pairing_problem``.
"""

from __future__ import annotations

from typing import NamedTuple

from pdwire.models import InstanceSpec, KVIdentity

# the identity fields that must be equal, in the order a refusal names them
_SAME = (
    "model",
    "dtype",
    "kv_cache_dtype",
    "block_size",
    "head_size",
    "num_kv_heads",
    "num_layers",
    "use_mla",
    "protocol",
)


def heads_of(rank: int, tp: int, num_heads: int) -> tuple[int, int]:
    """(first global head, count) held by ``rank``; raises ``ValueError`` for a split vLLM
    cannot make."""
    if tp <= num_heads:
        if num_heads % tp:
            raise ValueError(f"{num_heads} KV heads do not split over tp {tp}")
        per = num_heads // tp
        return rank * per, per
    if tp % num_heads:
        raise ValueError(f"tp {tp} is not a multiple of {num_heads} KV heads")
    return rank // (tp // num_heads), 1


def pairing_problem(p_tp: int, d_tp: int, num_kv_heads: int | None, use_mla: bool) -> str | None:
    """Why P tp ``p_tp`` cannot push into D tp ``d_tp`` (``None``: it can).
    ``num_kv_heads``: the model's total KV heads (``None``: not known, the sizes alone)."""
    if p_tp < 1 or d_tp < 1:
        return f"TP sizes must be positive (P {p_tp}, D {d_tp})"
    if max(p_tp, d_tp) % min(p_tp, d_tp):
        return (
            f"P tp {p_tp} and D tp {d_tp}: one must divide the other for P's KV heads to map "
            "onto D's ranks"
        )
    if num_kv_heads is None and not use_mla:
        return None
    heads = 1 if use_mla else num_kv_heads or 1
    for side, tp in (("P", p_tp), ("D", d_tp)):
        try:
            heads_of(0, tp, heads)
        except ValueError as exc:
            return f"{side}: {exc}"
    return None


def identity_problem(p: KVIdentity, d: KVIdentity) -> str | None:
    """Why P's KV cannot be D's (``None``: it can): the first field that differs."""
    for name in _SAME:
        mine, theirs = getattr(p, name), getattr(d, name)
        if mine != theirs:
            what = "weights/config" if name == "model" else name
            return f"{what} differ: P {mine} vs D {theirs}"
    return None


class Mismatch(NamedTuple):
    reason: str  # "revision", "identity" or "layout" (the TP pairing)
    text: str


def instances_problem(p: InstanceSpec, d: InstanceSpec) -> Mismatch | None:
    """Why registered P instance ``p`` must not push into D instance ``d`` (``None``: it may):
    another revision, another KV identity, or TP sizes that cannot be paired. What an instance
    did not register (an older connector, a plain vLLM) is not held against it."""
    if p.revision and d.revision and p.revision != d.revision:
        return Mismatch("revision", f"revision P {p.revision} vs D {d.revision}")
    if p.kv is not None and d.kv is not None:
        problem = identity_problem(p.kv, d.kv)
        if problem is not None:
            return Mismatch("identity", problem)
    kv = d.kv or p.kv
    heads = kv.num_kv_heads if kv is not None else None
    problem = pairing_problem(p.tp_size, d.tp_size, heads, kv.use_mla if kv is not None else False)
    return Mismatch("layout", problem) if problem is not None else None
