"""Where one block's KV lives in memory, per attention backend, as byte regions.

A layer's cache is one or more *planes* (separate K and V tensors, or one tensor). Inside a
plane a block is either head-major — ``(heads, tokens, x)``: a slice of heads is one contiguous
run — or token-major — ``(tokens, heads, x)``: a slice of heads is one run per token, and only
all heads together are contiguous. Layouts:

* ``cpu``   vLLM CPU attention: one tensor ``(blocks, heads, block_size, 2*head)``, head-major
            (each (block, head) page holds all N keys then all N values).
* ``flash`` CUDA FlashAttention NHD: one tensor ``(2, blocks, block_size, heads, head)``: a K
            plane then a V plane, token-major. (Documented; no CUDA here.)
* ``npu``   vllm-ascend: separate K and V tensors ``(blocks, block_size, heads, head)``,
            token-major. (Documented; no NPU here.)
* ``mla``   latent cache ``(blocks, block_size, latent)``: one "head", replicated on all ranks.

``pieces`` turns (block, head slice) into ``(offset, length)`` regions relative to each plane's
base address; P and D describe the same layer with their own head counts and the two lists pair
up one to one. ``coalesce`` merges pieces that are contiguous on both sides.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from connector.errors import LayoutError

KINDS = ("cpu", "flash", "npu", "mla")


@dataclass(frozen=True, slots=True)
class LayerLayout:
    kind: str
    num_blocks: int
    num_heads: int
    block_size: int
    head_bytes: int  # bytes of one head of one token in one plane (cpu: K and V together)
    num_planes: int
    block_stride: int = 0  # bytes from one block to the next (0: blocks are packed)

    @property
    def stride(self) -> int:
        return self.block_stride or self.block_bytes

    @property
    def span(self) -> int:
        """Bytes from a plane's base to the end of its last block."""
        return (self.num_blocks - 1) * self.stride + self.block_bytes

    @property
    def block_bytes(self) -> int:
        """Bytes of one block in one plane."""
        return self.num_heads * self.block_size * self.head_bytes

    @property
    def head_major(self) -> bool:
        return self.kind in ("cpu", "mla")

    def pieces(self, block: int, head_start: int, head_count: int) -> list[tuple[int, int, int]]:
        """``(plane, offset, length)`` regions holding heads ``[head_start, +head_count)``."""
        if not 0 <= block < self.num_blocks:
            raise LayoutError(f"block {block} outside 0..{self.num_blocks - 1}")
        if head_start < 0 or head_count < 1 or head_start + head_count > self.num_heads:
            raise LayoutError(f"heads {head_start}+{head_count} outside 0..{self.num_heads}")
        out: list[tuple[int, int, int]] = []
        base = block * self.stride
        per_head = self.block_size * self.head_bytes
        for plane in range(self.num_planes):
            if self.head_major or head_count == self.num_heads:
                start = head_start * per_head if self.head_major else 0
                out.append((plane, base + start, head_count * per_head))
                continue
            token_stride = self.num_heads * self.head_bytes
            for t in range(self.block_size):
                off = base + t * token_stride + head_start * self.head_bytes
                out.append((plane, off, head_count * self.head_bytes))
        return out


def describe(
    kind: str,
    shape: tuple[int, ...],
    itemsize: int,
    num_planes: int = 1,
    block_stride: int = 0,
) -> LayerLayout:
    """Layout of one layer's cache tensor (for ``npu`` the shape of one of its K/V tensors).

    ``block_stride``: bytes between blocks when vLLM interleaves layers in one allocation.
    """
    if kind == "cpu":
        if len(shape) != 4:
            raise LayoutError(f"cpu KV cache must be (blocks, heads, block_size, 2*head): {shape}")
        b, h, n, c = shape
        return LayerLayout("cpu", b, h, n, c * itemsize, 1, block_stride)
    if kind == "flash":
        if len(shape) != 5 or shape[0] != 2:
            raise LayoutError(
                f"flash KV cache must be (2, blocks, block_size, heads, head): {shape}"
            )
        _, b, n, h, d = shape
        return LayerLayout("flash", b, h, n, d * itemsize, 2)
    if kind == "npu":
        if len(shape) != 4:
            raise LayoutError(f"npu K/V caches must be (blocks, block_size, heads, head): {shape}")
        b, n, h, d = shape
        return LayerLayout("npu", b, h, n, d * itemsize, num_planes, block_stride)
    if kind == "mla":
        if len(shape) != 3:
            raise LayoutError(f"mla KV cache must be (blocks, block_size, latent): {shape}")
        b, n, c = shape
        return LayerLayout("mla", b, 1, n, c * itemsize, 1, block_stride)
    raise LayoutError(f"unknown KV layout {kind!r} (known: {', '.join(KINDS)})")


def check_compatible(p: LayerLayout, d: LayerLayout) -> None:
    """P and D must agree on everything but the number of blocks and heads per rank."""
    same = (p.kind, p.block_size, p.head_bytes, p.num_planes)
    other = (d.kind, d.block_size, d.head_bytes, d.num_planes)
    if same != other:
        raise LayoutError(
            f"KV layouts differ (kind, block_size, head_bytes, planes): P {same} vs D {other}"
        )


Piece = tuple[int, int, int, int]  # plane, src offset, dst offset, length


def pair_pieces(
    p: LayerLayout,
    d: LayerLayout,
    blocks: Iterable[tuple[int, int]],
    p_heads: tuple[int, int],
    d_head_start: int,
) -> list[Piece]:
    """Pieces copying P's heads ``p_heads`` of each (p_block, d_block) to D's ``d_head_start``."""
    out: list[Piece] = []
    for pb, db in blocks:
        src = p.pieces(pb, p_heads[0], p_heads[1])
        dst = d.pieces(db, d_head_start, p_heads[1])
        for (plane, s, n), (_, t, _) in zip(src, dst, strict=True):
            out.append((plane, s, t, n))
    return coalesce(out)


def coalesce(pieces: list[Piece]) -> list[Piece]:
    """Merge pieces adjacent on both sides (consecutive blocks → one large write)."""
    out: list[Piece] = []
    for piece in sorted(pieces):
        if out:
            plane, s, t, n = out[-1]
            if plane == piece[0] and s + n == piece[1] and t + n == piece[2]:
                out[-1] = (plane, s, t, n + piece[3])
                continue
        out.append(piece)
    return out
