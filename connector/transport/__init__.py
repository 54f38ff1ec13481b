"""Transports move bytes from registered local memory into a peer's registered memory.

``Transport`` is the seam; ``MooncakeTransport`` (tcp | rdma | ascend) serves production and the
two-process tests, ``InProcessTransport`` serves single-process tests and fault injection.
"""

from __future__ import annotations

from connector.transport.base import Transport, make_transport
from connector.transport.inprocess import InProcessTransport

__all__ = ["InProcessTransport", "Transport", "make_transport"]
