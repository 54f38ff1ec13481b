"""Heterogeneous tensor parallelism: which P rank writes which KV heads into which D rank.

Which heads a rank holds, and which pairings work, are ``pdwire.compat``'s rules (vLLM's
split; either TP size may be the larger, as long as one divides the other). Every head a D
rank holds is written into it by exactly one P rank (a *leg*: one P rank → one D rank, a
contiguous run of heads). When several P ranks hold the same head (P tp > H, or MLA), the D
ranks that hold that head take turns among them, so the writes spread over P's replicas
instead of all leaving one rank. A P rank may therefore write to several D ranks (D tp > P tp:
its heads split over D's ranks, or the same heads replicated into each) or to none (a P
replica no D rank needs). D rank d waits for one done signal per P rank that writes into it
(``expected``).
"""

from __future__ import annotations

from dataclasses import dataclass

from connector.errors import LayoutError
from pdwire import compat


@dataclass(frozen=True, slots=True)
class Route:
    """One leg: what P rank ``p_rank`` writes into D rank ``d_rank``."""

    d_rank: int
    p_head_start: int  # the first head written, in P's local head axis
    num_heads: int  # heads written (a contiguous run)
    d_head_start: int  # where they go in D's local head axis
    expected: int  # done signals D rank ``d_rank`` waits for (one per P rank writing into it)


def heads_of(rank: int, tp: int, num_heads: int) -> tuple[int, int]:
    """(first global head, count) held by ``rank``."""
    try:
        return compat.heads_of(rank, tp, num_heads)
    except ValueError as exc:
        raise LayoutError(str(exc)) from None


def check_pairing(p_tp: int, d_tp: int, num_heads: int | None, use_mla: bool) -> None:
    """Raise ``LayoutError`` (saying why) unless P tp ``p_tp`` can push into D tp ``d_tp``
    (``num_heads``: total KV heads; ``None``: not known, only the TP sizes are checked)."""
    problem = compat.pairing_problem(p_tp, d_tp, num_heads, use_mla)
    if problem is not None:
        raise LayoutError(problem)


def _writer(head: int, d_rank: int, p_tp: int, d_tp: int, heads: int) -> int:
    """The P rank that writes global ``head`` into D rank ``d_rank``."""
    holders = [r for r in range(p_tp) if _holds(r, p_tp, heads, head)]
    d_holders = [r for r in range(d_tp) if _holds(r, d_tp, heads, head)]
    return holders[d_holders.index(d_rank) % len(holders)]


def _holds(rank: int, tp: int, heads: int, head: int) -> bool:
    start, count = heads_of(rank, tp, heads)
    return start <= head < start + count


def _writers(d_rank: int, p_tp: int, d_tp: int, heads: int) -> list[int]:
    """Per head of D rank ``d_rank`` (in its local order): the P rank that writes it."""
    start, count = heads_of(d_rank, d_tp, heads)
    return [_writer(h, d_rank, p_tp, d_tp, heads) for h in range(start, start + count)]


def expected_signals(d_rank: int, p_tp: int, d_tp: int, num_heads: int, use_mla: bool) -> int:
    """Done signals D rank ``d_rank`` waits for: one per P rank writing into it."""
    check_pairing(p_tp, d_tp, num_heads, use_mla)
    return len(set(_writers(d_rank, p_tp, d_tp, 1 if use_mla else num_heads)))


def routes(p_rank: int, p_tp: int, d_tp: int, num_heads: int, use_mla: bool) -> list[Route]:
    """Every leg P rank ``p_rank`` writes, in D rank order (empty: a replica with nothing to
    write)."""
    check_pairing(p_tp, d_tp, num_heads, use_mla)
    heads = 1 if use_mla else num_heads
    p_start, _ = heads_of(p_rank, p_tp, heads)
    out: list[Route] = []
    for d in range(d_tp):
        writers = _writers(d, p_tp, d_tp, heads)
        mine = [i for i, w in enumerate(writers) if w == p_rank]
        if not mine:
            continue
        if mine != list(range(mine[0], mine[0] + len(mine))):  # a rank's heads are contiguous
            raise LayoutError(f"P rank {p_rank}'s heads in D rank {d} are not contiguous")
        d_start, _ = heads_of(d, d_tp, heads)
        first = d_start + mine[0]  # global head
        out.append(
            Route(
                d_rank=d,
                p_head_start=first - p_start,
                num_heads=len(mine),
                d_head_start=mine[0],
                expected=len(set(writers)),
            )
        )
    return out
