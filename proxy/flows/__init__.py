"""P/D flows: decode-first (and concurrent) with metaserver bindings, ascend-layerwise (the same
for unchanged vllm-ascend engines), prefill-first relay, and
direct (no disaggregation). Each one turns an ``Attempt`` into D's ``Upstream``."""

from proxy.flows.ascend import AscendLayerwise
from proxy.flows.base import Attempt, Flow, Legs, Timeouts, Upstream
from proxy.flows.decode_first import DecodeFirst
from proxy.flows.direct import Direct
from proxy.flows.prefill_first import PrefillFirst

__all__ = [
    "AscendLayerwise",
    "Attempt",
    "DecodeFirst",
    "Direct",
    "Flow",
    "Legs",
    "PrefillFirst",
    "Timeouts",
    "Upstream",
]
