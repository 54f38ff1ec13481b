"""Wire models of the metaserver's HTTP API (validated once, at the edge), all under one name.

Each concept has its module; this one gathers them, so that ``pdwire.models.X`` names every
body whichever module defines it:

* ``pdwire.fields`` — the shared field types and limits, the strict base;
* ``pdwire.bindings`` — a *binding* says where the prefill instance must push the KV of one
  transfer (which decode instance, its KV endpoint, the block ids it allocated), with its
  events and marks;
* ``pdwire.instances`` — an *instance* is a vLLM server that registered itself (and keeps
  heartbeating) so that bindings may point at it;
* ``pdwire.kvindex`` — KV-event index lookups and placements; ``pdwire.loadboard`` — the
  proxy replicas' shared load; ``pdwire.batch`` — several binding writes in one request.
"""

from __future__ import annotations

from pdwire.batch import BATCH_MAX_CALLS, BATCH_PATH, BatchCall, BatchIn, BatchOut, BatchResult
from pdwire.bindings import (
    Binding,
    BindingSpec,
    BindingState,
    Event,
    EventDetail,
    EventIn,
    Mark,
    MarkDetail,
    MarkIn,
    MarkKind,
    Stats,
)
from pdwire.fields import (
    MAX_BLOCKS_PER_GROUP,
    MAX_KV_GROUPS,
    MAX_TP_SIZE,
    BlockId,
    Host,
    Label,
    Name,
    Port,
)
from pdwire.instances import (
    LATER_FIELDS,
    Instance,
    InstanceRole,
    InstanceSpec,
    KVEndpoint,
    KVEvents,
    KVIdentity,
)
from pdwire.kvindex import (
    KV_MATCH_MAX_KEYS,
    KV_MATCH_MAX_PRODUCT,
    KV_MATCH_PATH,
    KV_PLACED_MAX,
    KV_PLACED_PATH,
    BlockKey,
    KVMatchIn,
    KVMatchOut,
    KVPlacedIn,
    KVPlacement,
)
from pdwire.loadboard import LOAD_PATH, LoadReport, LoadView, Url

__all__ = [
    "BATCH_MAX_CALLS",
    "BATCH_PATH",
    "KV_MATCH_MAX_KEYS",
    "KV_MATCH_MAX_PRODUCT",
    "KV_MATCH_PATH",
    "KV_PLACED_MAX",
    "KV_PLACED_PATH",
    "LATER_FIELDS",
    "LOAD_PATH",
    "MAX_BLOCKS_PER_GROUP",
    "MAX_KV_GROUPS",
    "MAX_TP_SIZE",
    "BatchCall",
    "BatchIn",
    "BatchOut",
    "BatchResult",
    "Binding",
    "BindingSpec",
    "BindingState",
    "BlockId",
    "BlockKey",
    "Event",
    "EventDetail",
    "EventIn",
    "Host",
    "Instance",
    "InstanceRole",
    "InstanceSpec",
    "KVEndpoint",
    "KVEvents",
    "KVIdentity",
    "KVMatchIn",
    "KVMatchOut",
    "KVPlacedIn",
    "KVPlacement",
    "Label",
    "LoadReport",
    "LoadView",
    "Mark",
    "MarkDetail",
    "MarkIn",
    "MarkKind",
    "Name",
    "Port",
    "Stats",
    "Url",
]
