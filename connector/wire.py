"""Side-channel messages between a P worker rank and a D worker rank (msgpack over ZeroMQ).

P → D ``Hello``: asks for D's KV memory description (the handshake).
D → P ``Welcome``: transport session, per-layer plane base addresses, D's layouts (P writes
into them, whatever its own), and ``epoch``
(random per D process: a changed epoch means D restarted and cached handshakes are stale).
P → D ``Signal``: a transfer ended on one P rank (``ok``), with how many signals D should expect.

``Hello``, ``Welcome`` and ``Refused`` carry the sender's ``protocol`` (``pdwire.version``); each
side reads it before the rest of the message (``protocol_of``), so peers of different releases
refuse each other with that reason instead of failing on a field they do not know.
"""

from __future__ import annotations

from typing import Annotated, Any

import msgspec

from connector.layout import LayerLayout
from pdwire.version import UNVERSIONED


class Hello(msgspec.Struct, tag="hello", frozen=True):
    p_engine_id: str
    protocol: int = UNVERSIONED


class Welcome(msgspec.Struct, tag="welcome", frozen=True):
    engine_id: str
    epoch: str
    tp_rank: int
    tp_size: int
    session: str
    layer_names: list[str]
    layer_bases: list[list[int]]  # per layer, per plane: absolute base address
    layouts: list[LayerLayout]  # the distinct layouts of D's layers (strides and all)
    layer_layouts: list[int]  # per layer: its index in ``layouts``
    protocol: int = UNVERSIONED

    def layout(self, layer: int) -> LayerLayout:
        return self.layouts[self.layer_layouts[layer]]


# The largest message a D rank reads: a Signal with ``verify_kv`` digests is about 21 bytes per
# piece written (a 128k-token prompt of an 80-layer model, heads split: about 30 MB); ZeroMQ
# drops the connection of a peer that sends more, before it is buffered whole
MAX_FRAME_BYTES = 256 << 20

# The longest a failed write may still land: Mooncake's write and lane deadlines at the
# connector's limit for write_timeout_s (600 s), plus 2 s (transport/mooncake.py)
MAX_SETTLE_S = 2 * 600 + 2.0


class Refused(msgspec.Struct, tag="refused", frozen=True):
    reason: str
    protocol: int = UNVERSIONED


INSTANCE_LABEL = r"^[A-Za-z0-9._:-]*$"  # what a metric label of D may carry


class Signal(msgspec.Struct, tag="signal", frozen=True):
    transfer_id: str
    sender: str  # "<p engine id>/<p rank>"
    ok: bool
    expected: int
    error: str = ""
    # with ``verify_kv``: (D layer index, D address, length, crc32) of every piece written
    digests: list[tuple[int, int, int, int]] = []
    # a write of this transfer failed (then was retried, or the transfer failed): its pieces
    # may still land for this many seconds, so D must not use or free the blocks before then;
    # bounded, so that no message can keep D's blocks forever (D drops a Signal above it)
    settle_s: Annotated[float, msgspec.Meta(ge=0, le=MAX_SETTLE_S)] = 0.0
    # P's instance id (the registry's): D counts each P's blocks under it ("" from older P)
    instance: Annotated[str, msgspec.Meta(max_length=128, pattern=INSTANCE_LABEL)] = ""


class Alive(msgspec.Struct, tag="alive", frozen=True):
    """P's sender is alive and these transfers to this D rank are still open: sent every
    ``keepalive_s`` while a push is open. D fails a load whose P went silent (``silence_s``)."""

    sender: str  # "<p engine id>/<p rank>"
    transfer_ids: list[str]


Message = Hello | Welcome | Refused | Signal | Alive

_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(Message)


def encode(msg: Message) -> bytes:
    return _encoder.encode(msg)


def decode(data: bytes) -> Message:
    msg: Message = _decoder.decode(data)
    return msg


def protocol_of(data: bytes) -> tuple[str, int]:
    """(message type, protocol) of any release's message, read without its schema."""
    try:
        raw: Any = msgspec.msgpack.decode(data)
    except msgspec.DecodeError:
        return "", UNVERSIONED
    if not isinstance(raw, dict):
        return "", UNVERSIONED
    version = raw.get("protocol", UNVERSIONED)
    return str(raw.get("type", "")), version if isinstance(version, int) else UNVERSIONED
