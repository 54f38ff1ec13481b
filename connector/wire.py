"""Side-channel messages between a P worker rank and a D worker rank (msgpack over ZeroMQ).

P → D ``Hello``: asks for D's KV memory description (the handshake).
D → P ``Welcome``: transport session, per-layer plane base addresses, D's layouts (P writes
into them, whatever its own), and ``epoch``
(random per D process: a changed epoch means D restarted and cached handshakes are stale).
P → D ``Signal``: a transfer ended on one P rank (``ok``), with how many signals D should expect;
with digests (``verify_kv``, or proof of arrival), those that do not fit in it went ahead in
``Digests`` messages (at most ``MAX_DIGESTS_PER_MESSAGE`` each), so no message is larger than
``MAX_FRAME_BYTES``.

``Hello``, ``Welcome`` and ``Refused`` carry the sender's ``protocol`` (``pdwire.version``); each
side reads it before the rest of the message (``protocol_of``), so peers of different releases
refuse each other with that reason instead of failing on a field they do not know.
"""

from __future__ import annotations

from typing import Annotated, Any

import msgspec

from connector.layout import LayerLayout
from pdwire.ids import ID_BODY
from pdwire.models import MAX_TP_SIZE
from pdwire.version import UNVERSIONED

# Bounds of what a peer may say (D logs P's strings, quoted and cut: ``connector/untrusted.py``)
MAX_NAME_CHARS = 300  # an engine id, and "/<rank>" after it
MAX_ERROR_CHARS = 1024  # why a push failed (P sends the start of a longer reason)
MAX_ALIVE_IDS = 4096  # transfers one keep-alive names (P sends several when it has more)
Name = Annotated[str, msgspec.Meta(max_length=MAX_NAME_CHARS)]
Error = Annotated[str, msgspec.Meta(max_length=MAX_ERROR_CHARS)]
# a whole transfer id (``\Z``: ``$`` would let a trailing newline through)
TransferId = Annotated[str, msgspec.Meta(pattern=rf"^{ID_BODY}\Z")]
# signals D waits for: one per P rank writing into a D rank, at most P's TP size
Expected = Annotated[int, msgspec.Meta(ge=1, le=MAX_TP_SIZE)]


class Hello(msgspec.Struct, tag="hello", frozen=True):
    p_engine_id: Name
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


# Digests per message: at most 27 bytes each in msgpack (an array of layer, address, length,
# crc32), so a Digests message or a Signal is under 1.8 MB. A transfer with more (a 128k-token
# prompt of an 80-layer model, heads split: about 1.4 M pieces) sends them in several.
MAX_DIGESTS_PER_MESSAGE = 65_536
# Digests one P rank may send for one transfer (16.8 M: more than the 256 MiB frame that used
# to carry them all in one Signal held); D fails the load of a sender that sends more
MAX_DIGESTS_PER_SENDER = 1 << 24
# The largest frame either side reads (ZeroMQ drops the connection of a peer that sends more,
# before it is buffered whole). The largest messages are far below it: a Signal or Digests
# (1.8 MB, above), an Alive naming 4,096 transfers (0.5 MB), a Welcome (about 90 bytes per
# layer: 9 KB for 100 layers; D refuses to start if its own would not fit).
MAX_FRAME_BYTES = 4 << 20

# The longest a failed write may still land: Mooncake's write and lane deadlines at the
# connector's limit for write_timeout_s (600 s), plus 2 s (transport/mooncake.py)
MAX_SETTLE_S = 2 * 600 + 2.0


class Refused(msgspec.Struct, tag="refused", frozen=True):
    reason: Error
    protocol: int = UNVERSIONED


INSTANCE_LABEL = r"^[A-Za-z0-9._:-]*\Z"  # what a metric label of D may carry


U32 = Annotated[int, msgspec.Meta(ge=0, le=2**32 - 1)]
U64 = Annotated[int, msgspec.Meta(ge=0)]  # (msgpack holds at most 64 bits)
Digest = tuple[Annotated[int, msgspec.Meta(ge=0, le=65_535)], U64, U64, U32]
DigestList = Annotated[list[Digest], msgspec.Meta(max_length=MAX_DIGESTS_PER_MESSAGE)]


class Signal(msgspec.Struct, tag="signal", frozen=True):
    transfer_id: TransferId
    sender: Name  # "<p engine id>/<p rank>"
    ok: bool
    expected: Expected
    error: Error = ""
    # with digests: (D layer index, D address, length, crc32) of pieces written: the last of
    # them (the rest went ahead in ``Digests`` messages)
    digests: DigestList = []
    # a write of this transfer failed (then was retried, or the transfer failed): its pieces
    # may still land for this many seconds, so D must not use or free the blocks before then;
    # bounded, so that no message can keep D's blocks forever (D drops a Signal above it)
    settle_s: Annotated[float, msgspec.Meta(ge=0, le=MAX_SETTLE_S)] = 0.0
    # P's instance id (the registry's): D counts each P's blocks under it ("" from older P)
    instance: Annotated[str, msgspec.Meta(max_length=128, pattern=INSTANCE_LABEL)] = ""
    # all of this sender's digests for the transfer: the ``Digests`` ahead of it and these
    digest_count: Annotated[int, msgspec.Meta(ge=0, le=MAX_DIGESTS_PER_SENDER)] = 0
    # this sender signs its pieces (its digests, none when it wrote none, are all there is)
    signed: bool = False


class Digests(msgspec.Struct, tag="digests", frozen=True):
    """Digests of a transfer's pieces that did not fit in its ``Signal``: sent just ahead of it
    on the same connection (ZeroMQ keeps their order)."""

    transfer_id: TransferId
    sender: Name  # "<p engine id>/<p rank>"
    digests: DigestList


def split_digests(digests: list[Digest]) -> tuple[list[list[Digest]], list[Digest]]:
    """(the parts that go ahead in ``Digests`` messages, the last part: the ``Signal``'s)."""
    n = MAX_DIGESTS_PER_MESSAGE
    parts = [digests[i : i + n] for i in range(0, len(digests), n)] or [[]]
    return parts[:-1], parts[-1]


class Alive(msgspec.Struct, tag="alive", frozen=True):
    """P's sender is alive and these transfers to this D rank are still open: sent every
    ``keepalive_s`` while a push is open. D fails a load whose P went silent (``silence_s``)."""

    sender: Name  # "<p engine id>/<p rank>"
    transfer_ids: Annotated[list[TransferId], msgspec.Meta(max_length=MAX_ALIVE_IDS)]


Message = Hello | Welcome | Refused | Signal | Digests | Alive

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
