"""A lean HTTP/1.1 client for the data path (``--http-client native``)."""

from proxy.native.backend import NativeBackend
from proxy.native.pool import Pools, Target

__all__ = ["NativeBackend", "Pools", "Target"]
