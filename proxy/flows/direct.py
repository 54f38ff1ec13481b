"""direct: no disaggregation — D computes the prompt itself (short or cached prompts)."""

from __future__ import annotations

from proxy.flows.base import Attempt, Legs, Upstream


class Direct:
    name = "direct"
    needs_prefill = False

    def __init__(self, legs: Legs) -> None:
        self._legs = legs

    async def open(self, a: Attempt) -> Upstream:
        return await self._legs.decode(a, a.decode_body(None), a.leg_span("decode", a.decode.url))
