"""The one quantile of the metaserver's figures (``/v1/breakdown``'s stages, TTFT and ITL, the
advice's floors, ``/v1/stats``'s bound→done latency): nearest rank, so every figure is a value
that was measured, never one made up between two."""

from __future__ import annotations

import math
from collections.abc import Sequence


def quantile(sorted_values: Sequence[float], q: float) -> float:
    """Nearest-rank ``q`` quantile (0 < q ≤ 1) of a non-empty sorted list: its
    ⌈q·n⌉-th smallest value."""
    n = len(sorted_values)
    return sorted_values[min(n - 1, max(0, math.ceil(q * n) - 1))]
