"""pdgate metaserver: bindings (transfer → decode KV endpoint) and the instance registry.

``create_app`` builds the HTTP service around a backend (a ``Store``, memory or Redis, with the
KV index and the load board beside it); the clients for the other parts live in
``pdwire.client``.
"""

from metaserver.app import create_app
from metaserver.backend import create_store
from metaserver.config import MetaserverSettings
from metaserver.store import MemoryStore, Store

__all__ = ["MemoryStore", "MetaserverSettings", "Store", "create_app", "create_store"]
