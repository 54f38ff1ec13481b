"""Layer tasks → coalesced pieces → one write per D session.

A ``Part`` is one layer task's pieces as absolute addresses (P's source, D's destination); a
``Write`` gathers the parts bound for one D session over several tasks, sent as one batched
transport write. The pieces of a chunk are computed once per (P layout, D layout) pair and kept
on the transfer while the chunk's layers go out.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

from connector.errors import LayoutError
from connector.layout import check_compatible, pair_pieces
from connector.worker.handshake import Peer
from connector.worker.memory import KVMemory
from connector.worker.transfer import ChunkPieces, LayerTask


class Pieces(NamedTuple):
    """Parallel lists, as ``Transport.write`` takes them."""

    src: list[int]
    dst: list[int]
    lengths: list[int]


@dataclass(frozen=True, slots=True)
class Part:
    """One layer task's share of a write."""

    task: LayerTask
    d_layer: int  # the layer's index on D (what digests name)
    pieces: Pieces

    @property
    def nbytes(self) -> int:
        return sum(self.pieces.lengths)


@dataclass(slots=True)
class Write:
    """Pieces bound for one D session, gathered over several layer tasks."""

    session: str
    src: list[int] = field(default_factory=list)
    dst: list[int] = field(default_factory=list)
    lengths: list[int] = field(default_factory=list)
    parts: list[Part] = field(default_factory=list)

    def add(self, part: Part) -> None:
        self.src.extend(part.pieces.src)
        self.dst.extend(part.pieces.dst)
        self.lengths.extend(part.pieces.lengths)
        self.parts.append(part)


class Batch(dict[str, Write]):
    """The writes being gathered, per D session."""

    def add(self, session: str, part: Part) -> None:
        write = self.get(session)
        if write is None:
            write = self[session] = Write(session)
        write.add(part)


def part_of(task: LayerTask, peer: Peer, memory: KVMemory) -> Part:
    """``task``'s pieces into ``peer``; raises ``LayoutError`` or ``KeyError`` (a layer D
    lacks)."""
    tr = task.transfer
    name = memory.layer_names[task.layer]
    d_index = peer.layer_index[name]
    key = (memory.layer_layout[task.layer], peer.welcome.layer_layouts[d_index])
    if tr.cached is None or tr.cached.pairs is not task.pairs:
        tr.cached = ChunkPieces(task.pairs)
    pieces = tr.cached.by_layout.get(key)
    if pieces is None:
        heads = (tr.route.p_head_start, tr.route.num_heads)
        pieces = pair_pieces(
            memory.layouts[key[0]],
            peer.welcome.layouts[key[1]],
            task.pairs,
            heads,
            tr.route.d_head_start,
        )
        tr.cached.by_layout[key] = pieces
    src_bases = memory.bases[task.layer]
    dst_bases = peer.welcome.layer_bases[d_index]
    return Part(
        task,
        d_index,
        Pieces(
            [src_bases[p.plane] + p.src for p in pieces],
            [dst_bases[p.plane] + p.dst for p in pieces],
            [p.length for p in pieces],
        ),
    )


def check_pairable(memory: KVMemory, peer: Peer) -> None:
    """Refuse, at the handshake, a D whose KV this P cannot write: a layer D lacks, or a
    layout that cannot be paired (block size, dtype, bytes per token-head)."""
    missing = [n for n in memory.layer_names if n not in peer.layer_index]
    if missing:
        raise LayoutError(
            f"D has no KV layer {missing[0]!r} ({len(missing)} of P's "
            f"{len(memory.layer_names)} layers missing)"
        )
    for layer, name in enumerate(memory.layer_names):
        try:
            check_compatible(memory.layout(layer), peer.welcome.layout(peer.layer_index[name]))
        except LayoutError as exc:
            raise LayoutError(f"layer {name}: {exc}") from None
