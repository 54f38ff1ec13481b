"""decode-first with a metaserver binding (the layerwise push flow): its plan for the shared
walk (``proxy.flows.walk``).

1. D gets the request with ``{do_remote_prefill, transfer_id, metaserver}``; its connector
   allocates blocks and writes the binding.
2. The proxy long-polls the binding, then sends P the prefill request carrying it (``decode``,
   the metaserver's JSON embedded as it came); P pushes KV into D's blocks and signals D.
   *Concurrent* mode sends P at once, without the binding: P's connector fetches it itself.
3. Every fallback of the walk applies. P's answer says ``push: none`` when its connector refused
   the binding (a decoder the registry does not vouch for, a block size or TP pairing it cannot
   serve, D's deadline already gone): D would wait its whole load deadline for KV that will
   never come, so the proxy drops D's leg and sends D the plain request instead; D computes the
   prompt itself. So does a binding that cannot be read (the metaserver not answering, refusing
   or failing would fail every attempt alike, and D needs no metaserver to compute the prompt),
   one naming another D than the chosen one, P's leg breaking after P took the binding (P killed
   mid-push, read back from the binding: a retry's P would prefill the whole prompt again), and
   P's first token differing from D's.
"""

from __future__ import annotations

from typing import Any

import msgspec

from pdwire.params import decode_leg, prefill_leg
from proxy.backend import LegError
from proxy.errors import BindingTimeout, MetaserverUnavailable, UpstreamError
from proxy.events import EventSink
from proxy.flows.base import Attempt, Legs, Upstream
from proxy.flows.bindings import BindingMissing, BindingSource
from proxy.flows.walk import Fallbacks, Walk


class _Names(msgspec.Struct):
    decode_instance_id: str


_names = msgspec.json.Decoder(_Names)  # reads one field of the binding P is sent as it is


class DecodeFirst:
    """decode-first (``concurrent``: P sent at once, its connector fetches the binding)."""

    needs_prefill = True
    fallbacks = Fallbacks(unreadable=True, foreign=True, no_push=True, p_failed=True, mismatch=True)

    def __init__(
        self, legs: Legs, bindings: BindingSource, events: EventSink, *, concurrent: bool = False
    ) -> None:
        self._walk = Walk(legs, bindings, events)
        self._bindings = bindings
        self._url = bindings.base_url
        self._wait_s = legs.timeouts.binding_wait
        self.waits = not concurrent
        self.name = "concurrent" if concurrent else "decode-first"

    async def open(self, a: Attempt) -> Upstream:
        return await self._walk.run(a, self)

    def begin(self, a: Attempt) -> tuple[str, ...]:
        return (a.tid,)

    def decode_params(self, a: Attempt, traceparent: str | None) -> dict[str, Any]:
        return decode_leg(a.tid, self._url, traceparent)

    async def binding(self, a: Attempt, ids: tuple[str, ...]) -> msgspec.Raw:
        try:
            return await self._bindings.wait(a.tid, self._wait_s)
        except BindingMissing as exc:
            err = BindingTimeout(f"no binding for {a.tid} within {self._wait_s}s")
            raise LegError(err, a.decode.url, "binding") from exc
        except MetaserverUnavailable:
            raise  # the walk lets D compute the prompt itself
        except UpstreamError as exc:
            err2 = UpstreamError(f"metaserver: {exc.message}")
            raise LegError(err2, self._url, "binding") from exc

    def foreign(self, a: Attempt, binding: msgspec.Raw) -> str | None:
        """P must push only into the D this request was sent to (``None``: the binding is the
        chosen D's, or the registry does not know D)."""
        if a.decode.spec is None:
            return None
        named = _names.decode(binding).decode_instance_id
        return None if named == a.decode.id else f"it names {named}, {a.decode.id} was chosen"

    def prefill_params(
        self,
        a: Attempt,
        binding: msgspec.Raw | None,
        ids: tuple[str, ...],
        traceparent: str | None,
    ) -> dict[str, Any]:
        chosen = a.decode.id if a.decode.spec is not None else None  # P refuses another D's
        return prefill_leg(a.tid, self._url, binding, traceparent, chosen)
