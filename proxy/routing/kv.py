"""KV-event routing's part in a request's route (``proxy.kvroute``): the request is matched
against the index before any choice (``KVAnnotator``), the placements the match could not show
yet count before each choice (``KVPlacement.choosing``), each choice is placed in the index at
once so every replica counts the prompt as held there (``KVPlacement.chosen``), and the
matches the choice was made on go with the answer to the binding's ``first_token`` mark
(``KVPlacement.routed``: ``Upstream.kv_held``)."""

from __future__ import annotations

from proxy.flows import Upstream
from proxy.instances import Instance, Registry, Role
from proxy.kvroute.lookup import KVLookup
from proxy.policies import RequestInfo
from proxy.rewrite import ClientRequest
from proxy.routing.select import Selection
from proxy.tracing import RequestSpan


class KVAnnotator:
    def __init__(self, lookup: KVLookup, registry: Registry) -> None:
        self._lookup = lookup
        self._registry = registry

    async def annotate(self, info: RequestInfo, req: ClientRequest, trace: RequestSpan) -> None:
        reg = self._registry
        instances = [*reg.available(Role.PREFILL), *reg.available(Role.DECODE)]
        await self._lookup.annotate(info, req.body, req.chat, instances)
        req.tokens = info.tokens  # exact once tokenized; D's load is released by this count
        if trace.recording and info.kv is not None:
            trace.event(
                "kv_match",
                {"pdgate.prompt_tokens": info.tokens,
                 "pdgate.kv.matched": " ".join(
                     f"{url}={m.blocks}/{m.of}" for url, m in info.kv.items())},
            )  # fmt: skip


class KVPlacement:
    def __init__(self, lookup: KVLookup) -> None:
        self._lookup = lookup

    async def choosing(self, info: RequestInfo) -> None:
        self._lookup.pending(info)  # never suspends: runs even for a request cancelled now

    def chosen(self, sel: Selection) -> None:
        if sel.info.kv is None:
            return
        self._lookup.placed(sel.decode, sel.info)
        if sel.prefill is not None:
            self._lookup.placed(sel.prefill, sel.info)

    def released(self, inst: Instance) -> None:
        return None

    def routed(self, sel: Selection, up: Upstream) -> None:
        if sel.info.kv is not None:
            up.kv_held = {m.instance_id: m.blocks for m in sel.info.kv.values()}
