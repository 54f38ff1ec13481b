"""The connector's exceptions (malformed ``kv_transfer_params``: ``pdwire.errors.ParamsError``).

ConnectorError
├── ConfigError           bad kv_connector_extra_config (raised at start)
├── LayoutError           KV caches P and D cannot exchange (shapes, dtype, TP ratio)
├── HandshakeError        a decode instance did not answer / refused the handshake
├── TransferError         the transport failed to write
└── UntrustedDestination  a binding names an instance the metaserver registry does not know
"""

from __future__ import annotations


class ConnectorError(Exception):
    pass


class ConfigError(ConnectorError):
    pass


class LayoutError(ConnectorError):
    pass


class HandshakeError(ConnectorError):
    pass


class TransferError(ConnectorError):
    pass


class UntrustedDestination(ConnectorError):
    pass
