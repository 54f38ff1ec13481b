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
