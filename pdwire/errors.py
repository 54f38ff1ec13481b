"""The contract's exceptions.

WireError
└── ParamsError     malformed ``kv_transfer_params`` (a request's, or P's push report)

The metaserver client's errors live in ``pdwire.client.errors``.
"""

from __future__ import annotations


class WireError(Exception):
    pass


class ParamsError(WireError):
    pass
