"""The caller of a route, as a FastAPI dependency, one alias per role a route requires: the
``Principal`` is resolved (401 without a known token where one is needed, 403 for a reader's
write) and its role checked (403 naming the role) before the route runs.

=============  ==========================================================================
``Reader``     any credential (none with ``--open-reads``)
``Writer``     any credential but a reader's; what it may write the route checks against
               the resource (``Principal.may_*``: an engine acts as its own instances only)
``KVAsker``    a reader that may ask the KV index: a proxy or an admin
``LoadSharer`` a writer that may share proxy load (and place prompts): a proxy or an admin
=============  ==========================================================================

A route whose role check must come after its path's validation (a malformed id is 422 whoever
asks) takes the id through a dependency of its own that checks the role (``bindings.routes``,
``load.routes``).
"""

from __future__ import annotations

from typing import Annotated

from fastapi import Depends, Request

from metaserver.access.principal import Principal
from metaserver.context import ctx


async def _reading(request: Request) -> Principal:
    return await ctx(request).authorize(request.headers.get("authorization"), write=False)


async def _writing(request: Request) -> Principal:
    return await ctx(request).authorize(request.headers.get("authorization"), write=True)


Reader = Annotated[Principal, Depends(_reading)]
Writer = Annotated[Principal, Depends(_writing)]


async def _asking_the_index(who: Reader) -> Principal:
    who.may_match()
    return who


async def _sharing_load(who: Writer) -> Principal:
    who.may_share_load()
    return who


KVAsker = Annotated[Principal, Depends(_asking_the_index)]
LoadSharer = Annotated[Principal, Depends(_sharing_load)]
