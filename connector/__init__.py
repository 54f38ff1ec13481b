"""pdgate's vLLM KV connector: decode-first, layer-wise push of prefill KV into decode blocks.

vLLM loads it with ``kv_connector_module_path="connector"``, ``kv_connector="PdgateConnector"``.

* ``PdgateConnector`` (connector.py) — the facade vLLM instantiates; builds one half.
* ``connector.scheduler`` — the scheduler half (bindings, chunk ranges, block lifetime).
* ``connector.worker`` — the worker half (sender and receiver, side channel, handshakes).
* ``connector.transport`` / ``connector.device`` — seams to Mooncake and to the accelerator.
* ``connector.layout`` / ``connector.tp`` — where KV bytes live; heterogeneous TP routing.
* ``connector.config`` — settings from ``kv_connector_extra_config``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from connector.connector import PdgateConnector

__all__ = ["PdgateConnector"]


def __getattr__(name: str) -> Any:
    # vLLM imports this package in the API process too; keep that import light.
    if name == "PdgateConnector":
        from connector.compat import check

        check()  # one clear line on an unsupported vLLM, before vLLM touches the class
        from connector.connector import PdgateConnector

        return PdgateConnector
    raise AttributeError(name)
