"""pdgate metaserver: bindings (transfer → decode KV endpoint) and the instance registry.

``create_app`` builds the HTTP service around a ``Store`` (memory or Redis); the clients for
the other parts live in ``pdwire.client``.
"""

from metaserver.app import create_app
from metaserver.config import MetaserverSettings
from metaserver.store import MemoryStore, Store, create_store

__all__ = ["MemoryStore", "MetaserverSettings", "Store", "create_app", "create_store"]
