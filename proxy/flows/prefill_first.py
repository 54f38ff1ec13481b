"""prefill-first relay for pull connectors (vLLM's NIXL / Mooncake): P computes the prompt
(max_tokens=1), answers with ``kv_transfer_params``, which go to D unchanged."""

from __future__ import annotations

from pdwire.params import pull_prefill_leg
from proxy.backend import LegError
from proxy.errors import UpstreamError
from proxy.flows.base import Attempt, Legs, Upstream, prefill_cached

PREFILL_PARAMS = pull_prefill_leg()  # built once: the legs never change it


class PrefillFirst:
    name = "prefill-first"
    needs_prefill = True

    def __init__(self, legs: Legs) -> None:
        self._legs = legs

    async def open(self, a: Attempt) -> Upstream:
        assert a.prefill is not None
        # vLLM's pull connectors read no traceparent: only the header carries it
        answer = await self._legs.prefill(a, PREFILL_PARAMS, a.leg_span("prefill", a.prefill.url))
        kv = answer.kv_transfer_params  # passed to D as it came (msgspec.Raw), never re-encoded
        if not bytes(kv).lstrip().startswith(b"{"):
            err = UpstreamError("prefill answered without kv_transfer_params")
            raise LegError(err, a.prefill.url, "prefill")
        up = await self._legs.decode(a, a.decode_body(kv), a.leg_span("decode", a.decode.url))
        up.prefill_cached = prefill_cached(answer)
        differ = await self._legs.first_tokens_differ(a, answer, up)
        if differ is None:
            return up
        up.close()  # D computes the prompt itself; the suspect answer is never sent
        self._legs.metrics.without_prefill.labels(reason="first_token_mismatch").inc()
        d_span = a.leg_span("decode", a.decode.url)
        d_span.set("pdgate.without_prefill", differ)
        return await self._legs.decode(a, a.decode_body(None), d_span)
