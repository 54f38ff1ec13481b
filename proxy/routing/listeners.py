"""What the attempt loop tells, as it happens, the concerns that follow a request's route
without steering it: each is a ``RouteListener``; the loop calls every one at each event, in
the order given. ``SharedLoad`` (``--share-load``) is here; KV-event routing's is in ``kv``."""

from __future__ import annotations

from typing import Protocol

from proxy.flows import Upstream
from proxy.instances import Instance
from proxy.instances.share import LoadSync
from proxy.policies import RequestInfo
from proxy.routing.select import Selection


class RouteListener(Protocol):
    async def choosing(self, info: RequestInfo) -> None:
        """Before each attempt's choice (may add to ``info``, or wait briefly for what the
        choice should see)."""
        ...

    def chosen(self, sel: Selection) -> None:
        """The attempt's instances are chosen and their load reserved."""
        ...

    def released(self, inst: Instance) -> None:
        """A request's load on ``inst`` was given back."""
        ...

    def routed(self, sel: Selection, up: Upstream) -> None:
        """D's first byte is in: the attempt is the request's."""
        ...


class SharedLoad:
    """The other replicas' load read before each choice; every change of this replica's load
    reported at once (``proxy.instances.share``)."""

    def __init__(self, sync: LoadSync) -> None:
        self._sync = sync

    async def choosing(self, info: RequestInfo) -> None:
        await self._sync.fresh()

    def chosen(self, sel: Selection) -> None:
        self._sync.changed()

    def released(self, inst: Instance) -> None:
        self._sync.changed()

    def routed(self, sel: Selection, up: Upstream) -> None:
        return None
