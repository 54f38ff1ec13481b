"""The protocol version: one integer that P, D and the metaserver's bindings carry.

It changes whenever a message between the parts changes in a way the other side cannot read
(a handshake field, a binding field P relies on, a signal). Peers of different versions refuse
each other — at P's admission of a binding (``push: none``) and at the P–D handshake — with
one line naming both versions, instead of failing somewhere later.

History: 1 — the first release (no version field; a missing version reads as 1).
2 — D's handshake describes its KV memory by strides (``LayerLayout`` per layer); bindings
state ``load_deadline`` and ``protocol``.
3 — the binding is the lease: P claims a transfer (``bound → prefill_started``, compare-and-set)
before it writes anything, and D frees the blocks of an aborted request at once when its own
``bound → aborted`` wins; P's sender keeps each open push alive with ``progress`` signals.
4 — side-channel frames are at most 4 MiB: digests that do not fit in a done signal go ahead of
it in ``Digests`` messages, and the signal counts them all (``digest_count``).
"""

from __future__ import annotations

PROTOCOL_VERSION = 4
UNVERSIONED = 1  # what a message without a version field speaks


def mismatch(theirs: int | None, who: str, ours: int = PROTOCOL_VERSION) -> str | None:
    """``None`` when ``who`` speaks our protocol, else the reason (one line)."""
    version = UNVERSIONED if theirs is None else theirs
    if version == ours:
        return None
    return (
        f"protocol version mismatch: {who} speaks pdgate protocol {version}, this side "
        f"{ours}; run the same pdgate release on P and D"
    )
