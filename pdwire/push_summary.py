"""The push summary P's connector puts in a ``done`` event's detail message, and its parser:
``push_s=… exposed_s=… tail_s=… hidden=… writes=… p_end_at=…``. The connector builds it
(``connector.worker.overlap``); the metaserver's breakdown, the timeline page and the TTFT bench
read it.
"""

from __future__ import annotations

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
