"""pdwire: the contract between pdgate's proxy, metaserver and connector.

The three parts depend on this package and on no other of the three; it depends on none of
FastAPI, vLLM, torch or Mooncake.

* ``pdwire.version`` — ``PROTOCOL_VERSION``, carried by bindings and by the P–D handshake;
* ``pdwire.ids`` — the transfer/instance id pattern (written once) and ``IdMaker``;
* ``pdwire.models`` — the metaserver's HTTP bodies under one name, each defined by its module:
  ``pdwire.bindings`` (bindings, their events and marks), ``pdwire.instances`` (registration),
  ``pdwire.kvindex`` (KV-event index lookups), ``pdwire.loadboard`` (the proxies' shared load),
  ``pdwire.batch`` (several writes in one request), over ``pdwire.fields`` (shared field types);
* ``pdwire.params`` — ``kv_transfer_params`` of each leg and P's push report, one builder and
  one parser per message;
* ``pdwire.trace`` — the W3C ``traceparent`` the proxy forwards to both legs (parser,
  formatter);
* ``pdwire.ascend`` — vllm-ascend's layerwise handoff (``MooncakeLayerwiseConnector``): its request
  ids, the body its decode engines post, the params of each leg;
* ``pdwire.client`` — the metaserver's clients (async, blocking, background writer), retry
  and backoff, ``binding_url``;
* ``pdwire.origin`` — an instance URL as an origin only; ``pdwire.compat`` — which P can push
  into which D; ``pdwire.kv_events`` / ``pdwire.block_hash`` — vLLM's KV events and block
  hashes; ``pdwire.feed`` — the binding feed's frames.

What the processes share beyond the contract (listeners, settings, ASGI, key files) is
``pdservice``.
"""

from __future__ import annotations

from pdwire.errors import ParamsError, WireError
from pdwire.ids import ID_PATTERN, IdMaker, valid_id
from pdwire.models import (
    Binding,
    BindingSpec,
    BindingState,
    EventDetail,
    EventIn,
    Instance,
    InstanceRole,
    InstanceSpec,
    KVEndpoint,
    Mark,
    MarkDetail,
    MarkIn,
    MarkKind,
)
from pdwire.params import (
    PushReport,
    RecvParams,
    SendParams,
    decode_leg,
    parse_decode_leg,
    parse_prefill_leg,
    parse_push_report,
    prefill_leg,
    pull_prefill_leg,
    push_report,
)
from pdwire.version import PROTOCOL_VERSION, mismatch

__all__ = [
    "ID_PATTERN",
    "PROTOCOL_VERSION",
    "Binding",
    "BindingSpec",
    "BindingState",
    "EventDetail",
    "EventIn",
    "IdMaker",
    "Instance",
    "InstanceRole",
    "InstanceSpec",
    "KVEndpoint",
    "Mark",
    "MarkDetail",
    "MarkIn",
    "MarkKind",
    "ParamsError",
    "PushReport",
    "RecvParams",
    "SendParams",
    "WireError",
    "decode_leg",
    "mismatch",
    "parse_decode_leg",
    "parse_prefill_leg",
    "parse_push_report",
    "prefill_leg",
    "pull_prefill_leg",
    "push_report",
    "valid_id",
]
