"""How much of a transfer's push work P hid behind its own compute.

The sender records, per transfer, the span of every batched write that carried its pieces and
the moment P's forward of the last chunk ended (``compute_end``). Write time after that moment
is *exposed*: D waits for it. The summary (``pdwire.push_summary``) goes into the ``done``
event's detail message.
"""

from __future__ import annotations

from collections.abc import Sequence

from pdwire.push_summary import PushOverlap


def overlap(
    spans: Sequence[tuple[float, float]],
    compute_end: float,
    ended_at: float,
    wall_offset: float = 0.0,
) -> PushOverlap:
    """``spans``: (start, end) of each write; times on one monotonic clock, which plus
    ``wall_offset`` gives the wall clock (0: not known)."""
    push = sum(end - start for start, end in spans)
    exposed = sum(max(0.0, end - max(start, compute_end)) for start, end in spans)
    tail = max(0.0, ended_at - compute_end) if compute_end else 0.0
    at = compute_end + wall_offset if wall_offset and compute_end else 0.0
    return PushOverlap(push, exposed, tail, len(spans), at)
