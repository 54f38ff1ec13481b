"""Heterogeneous tensor parallelism: which P rank writes which KV heads into which D rank.

Rank ``r`` of a TP group of size ``tp`` holds KV heads ``[r*H/tp, (r+1)*H/tp)`` when
``tp <= H``; when ``tp > H`` heads are replicated and rank r holds head ``r // (tp/H)``.
MLA caches have one latent "head" that every rank holds.

With ``ratio = P_tp / D_tp`` (a positive integer), D rank d is fed by P ranks
``[d*ratio, (d+1)*ratio)``. Among those, only the first holder of each head slice writes
(*primary*); replicas send nothing. D rank d waits for ``expected`` done signals: one per
primary P rank of its group (GQA: up to ``ratio``; MLA: 1).
"""

from __future__ import annotations

from dataclasses import dataclass

from connector.errors import LayoutError


@dataclass(frozen=True, slots=True)
class Route:
    d_rank: int
    num_heads: int  # heads this P rank writes (all of its local heads)
    d_head_start: int  # where they go in D's local head axis
    expected: int  # done signals D rank ``d_rank`` waits for


def heads_of(rank: int, tp: int, num_heads: int) -> tuple[int, int]:
    """(first global head, count) held by ``rank``."""
    if tp <= num_heads:
        if num_heads % tp:
            raise LayoutError(f"{num_heads} KV heads do not split over tp {tp}")
        per = num_heads // tp
        return rank * per, per
    if tp % num_heads:
        raise LayoutError(f"tp {tp} is not a multiple of {num_heads} KV heads")
    return rank // (tp // num_heads), 1


def _primary(rank: int, first: int, tp: int, num_heads: int) -> bool:
    return rank == first or heads_of(rank - 1, tp, num_heads)[0] != heads_of(rank, tp, num_heads)[0]


def ratio_of(p_tp: int, d_tp: int) -> int:
    if p_tp < d_tp or p_tp % d_tp:
        raise LayoutError(f"P tp {p_tp} must be a multiple of D tp {d_tp} (P tp >= D tp)")
    return p_tp // d_tp


def expected_signals(d_rank: int, p_tp: int, d_tp: int, num_heads: int, use_mla: bool) -> int:
    heads = 1 if use_mla else num_heads
    ratio = ratio_of(p_tp, d_tp)
    first = d_rank * ratio
    return sum(_primary(r, first, p_tp, heads) for r in range(first, first + ratio))


def route(p_rank: int, p_tp: int, d_tp: int, num_heads: int, use_mla: bool) -> Route | None:
    """Where P rank ``p_rank`` writes, or ``None`` when it is a replica that sends nothing."""
    heads = 1 if use_mla else num_heads
    ratio = ratio_of(p_tp, d_tp)
    d_rank = p_rank // ratio
    if not _primary(p_rank, d_rank * ratio, p_tp, heads):
        return None
    p_start, p_count = heads_of(p_rank, p_tp, heads)
    d_start, d_count = heads_of(d_rank, d_tp, heads)
    if not (d_start <= p_start and p_start + p_count <= d_start + d_count):
        raise LayoutError(f"P rank {p_rank} heads not inside D rank {d_rank} heads")
    return Route(
        d_rank=d_rank,
        num_heads=p_count,
        d_head_start=p_start - d_start,
        expected=expected_signals(d_rank, p_tp, d_tp, num_heads, use_mla),
    )
