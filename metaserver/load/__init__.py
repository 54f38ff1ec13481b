"""The load board: proxy replicas' shared in-flight load (``PUT`` / ``GET /v1/load/{replica}``).

Each replica reports its in-flight requests and tokens per instance (its open circuits, and each
instance's recent prefill work) every fraction of a second, and reads back the sum of the others'.
A report replaces the replica's previous one and lapses after its ``ttl_s``, so a replica that
stops reporting stops counting; reports are absolute (not deltas), so a lost one costs nothing
but staleness.

``board``: the interface and the sum; ``memory``: one metaserver process's board; ``redis``: the
board every replica of the metaserver shares (its scripts in ``redis_scripts``); ``routes``: the
HTTP edge. The backend (``metaserver.backend``) builds the board beside the store, on the same
medium.
"""

from metaserver.load.board import LoadBoard
from metaserver.load.memory import MemoryLoadBoard

__all__ = ["LoadBoard", "MemoryLoadBoard"]
