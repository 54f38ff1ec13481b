"""The metaserver's listener: uvicorn's httptools protocol with ``pdservice.listener``'s
receipt deadline (the whole request), per-client cap and write timeout."""

from __future__ import annotations

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from pdservice.listener import ListenerGuards


class GuardedHttpToolsProtocol(ListenerGuards, HttpToolsProtocol):
    pass
