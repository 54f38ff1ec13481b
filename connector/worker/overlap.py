"""How much of a transfer's push work P hid behind its own compute.

The sender records, per transfer, the span of every batched write that carried its pieces and
the moment P's forward of the last chunk ended (``compute_end``). Write time after that moment
is *exposed*: D waits for it. The summary goes into the ``done`` event's detail message.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class PushOverlap:
    push_s: float  # total time of the writes that carried this transfer's pieces
    exposed_s: float  # the part of it after P's compute ended
    tail_s: float  # compute end -> done signal sent to D
    writes: int
    compute_end_at: float = 0.0  # the same moment on the wall clock (0: unknown)

    @property
    def hidden(self) -> float:
        """Share of the push work that ran while P was still computing (1.0: all of it)."""
        if self.push_s <= 0:
            return 1.0
        return max(0.0, min(1.0, 1.0 - self.exposed_s / self.push_s))

    def message(self) -> str:
        return (
            f"push_s={self.push_s:.6f} exposed_s={self.exposed_s:.6f} "
            f"tail_s={self.tail_s:.6f} hidden={self.hidden:.3f} writes={self.writes} "
            f"p_end_at={self.compute_end_at:.6f}"
        )


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


def parse(message: str | None) -> dict[str, float]:
    """The numbers of a ``message()`` string (empty when there are none)."""
    out: dict[str, float] = {}
    for part in (message or "").split():
        key, sep, value = part.partition("=")
        if sep:
            try:
                out[key] = float(value)
            except ValueError:
                continue
    return out
