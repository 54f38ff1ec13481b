"""Noticing a client that goes away while its request is served."""

from __future__ import annotations

import asyncio
from typing import Any

from pdservice.asgi import Receive, Scope

ON_DISCONNECT = "pdgate.on_disconnect"  # scope slot: called by proxy.server on disconnect


class Watcher:
    """Cancels the request's task when the client goes away. Served by ``proxy.server``'s
    protocol, the scope carries an ``ON_DISCONNECT`` slot that the protocol calls from
    ``connection_lost``; elsewhere a task waits on ``receive()`` for ``http.disconnect``."""

    __slots__ = ("_scope", "_task", "_waiter", "finished", "gone")

    def __init__(self, task: asyncio.Task[Any], scope: Scope, receive: Receive) -> None:
        self._task = task
        self._scope = scope
        self.gone = False
        self.finished = False  # the client has the whole answer: hanging up is not an abort
        self._waiter: asyncio.Task[None] | None = None
        if ON_DISCONNECT in scope:
            scope[ON_DISCONNECT] = self.fire
        else:
            self._waiter = asyncio.get_running_loop().create_task(self._watch(receive))

    async def _watch(self, receive: Receive) -> None:
        while (await receive())["type"] != "http.disconnect":
            pass
        self.fire()

    def fire(self) -> None:
        if self.finished:
            return
        self.gone = True
        self._task.cancel()

    def finish(self) -> None:
        self.finished = True

    def cancel(self) -> None:
        if self._waiter is not None:
            self._waiter.cancel()
        else:
            self._scope[ON_DISCONNECT] = None
