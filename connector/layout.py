"""Where one layer's KV lives, read from its tensors, and the byte runs that copy it P → D.

Every layout is described through the logical view vLLM (0.32 and later) gives every attention
layer on every platform, ``[B, H, N, C]``: blocks, KV heads, tokens of a block, and content
(the bytes of one token of one head). Backends and devices differ only in the *physical*
order of those axes, and the strides say it: pages can be head-major or token-major, layers
can be interleaved per block, heads can be outer to blocks (every ``KVCacheLayout`` member).
Nothing here looks at the device.

A layer's cache is one or more *planes*, each holding a slice of a token-head's content:

* one tensor ``[B, H, N, C]`` (vLLM): one plane with all of it (K and V side by side);
* a tuple of tensors (vllm-ascend): K and V, or MLA's latent and rope parts, as separate
  ``[B, N, H, D]`` tensors; plane i holds the i-th slice of the content, in order.

A ``Plane`` is placed by byte strides (block, head, tokens; the content is contiguous). When
vLLM splits its blocks into smaller kernel blocks, a block's tokens span two axes (kernel
block, token in it). ``pair_pieces`` turns (P block, D block) pairs and a head range into
``Piece``s — byte runs between a plane of P and the same plane of D — merging every axis that is
contiguous on both sides, so P and D may use different physical layouts (and kernel blocks).
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Sequence
from typing import NamedTuple

import msgspec

from connector.errors import LayoutError

Axis = tuple[int, int]  # (size, byte stride)
# the logical axes a tensor's dimensions stand for: vLLM's view, or vllm-ascend's K/V tensors
VIEW_ORDERS = {"BHNC": (0, 1, 2, 3), "BNHC": (0, 2, 1, 3), "BNC": (0, 2, 3)}


class Plane(msgspec.Struct, frozen=True):
    content_start: int  # bytes: where this plane's slice of a token-head's content begins
    content_bytes: int
    dtype: str  # of the elements (a layer's planes may differ: int8 indexer beside bf16)
    block_stride: int  # bytes between consecutive blocks (vLLM's blocks, not kernel blocks)
    head_stride: int
    token_axes: tuple[Axis, ...]  # outer to inner; the sizes multiply to the block size

    def axes(self, num_blocks: int, num_heads: int) -> list[Axis]:
        return [
            (num_blocks, self.block_stride),
            (num_heads, self.head_stride),
            *self.token_axes,
            (self.content_bytes, 1),
        ]


class LayerLayout(msgspec.Struct, frozen=True):
    num_blocks: int
    num_heads: int  # KV heads on this rank (1 for MLA)
    block_size: int  # tokens per block, as vLLM's scheduler counts them
    planes: tuple[Plane, ...]

    @property
    def head_bytes(self) -> int:
        """Bytes of one token of one head, all planes together."""
        return sum(p.content_bytes for p in self.planes)

    @property
    def block_bytes(self) -> int:
        """Bytes one block holds, all planes together."""
        return self.num_heads * self.block_size * self.head_bytes

    def span(self, plane: int) -> int:
        """Bytes from a plane's base address to the end of its last byte."""
        axes = self.planes[plane].axes(self.num_blocks, self.num_heads)
        return sum((size - 1) * stride for size, stride in axes) + 1

    def locate(self, plane: int, offset: int) -> tuple[int, int]:
        """(block, head) holding the byte at ``offset`` from the plane's base."""
        p = self.planes[plane]
        named = [("b", (self.num_blocks, p.block_stride)), ("h", (self.num_heads, p.head_stride))]
        named += [("t", a) for a in p.token_axes]
        found = {"b": 0, "h": 0}
        rest = offset
        for name, (size, stride) in sorted(named, key=lambda x: -x[1][1]):
            index = min(rest // stride, size - 1) if size > 1 else 0
            rest -= index * stride
            if name in found:
                found[name] = index
        return found["b"], found["h"]

    def describe(self) -> str:
        planes = ", ".join(
            f"[{p.content_start}:{p.content_start + p.content_bytes}) {p.dtype} strides "
            f"b={p.block_stride} h={p.head_stride} n={'/'.join(str(s) for _, s in p.token_axes)}"
            for p in self.planes
        )
        return (
            f"{self.num_blocks} blocks x {self.num_heads} heads x {self.block_size} tokens x "
            f"{self.head_bytes} B; planes {planes}"
        )


class Piece(NamedTuple):
    plane: int
    src: int  # byte offset from the P plane's base
    dst: int  # byte offset from the D plane's base
    length: int


def plane_of(
    what: str,
    shape: Sequence[int],
    strides: Sequence[int],
    itemsize: int,
    dtype: str,
    order: str,
    block_size: int | None,
    content_start: int,
) -> tuple[Plane, int, int]:
    """One tensor as a plane: ``(plane, num_blocks, num_heads)``.

    ``strides`` are in elements (torch's), ``order`` names what the tensor's dimensions are
    (a key of ``VIEW_ORDERS``), ``block_size`` is vLLM's block (``None``: the tensor's own).
    Refuses, naming ``what`` with its shape and strides, anything that is not a set of dense,
    non-overlapping pages with contiguous content.
    """
    where = f"{what}: shape {tuple(shape)} strides {tuple(strides)}"
    dims = VIEW_ORDERS[order]
    if len(shape) != len(dims) or len(strides) != len(dims):
        raise LayoutError(f"{where}: expected a {len(dims)}-d {order} tensor")
    size = [1, 1, 1, 1]
    stride = [0, 0, 0, 0]
    for dim, axis in enumerate(dims):
        size[axis], stride[axis] = int(shape[dim]), int(strides[dim]) * itemsize
    blocks, heads, tokens, content = size
    if min(size) < 1:
        raise LayoutError(f"{where}: an empty dimension")
    if content > 1 and stride[3] != itemsize:
        raise LayoutError(f"{where}: the content of a token-head is not contiguous")
    _check_injective(where, [*zip(size[:3], stride[:3], strict=True), (content * itemsize, 1)])
    token_axes: tuple[Axis, ...] = ((tokens, stride[2]),)
    block_stride = stride[0]
    want = block_size or tokens
    if tokens != want:
        ratio = want // tokens
        if tokens > want or want % tokens or blocks % ratio:
            raise LayoutError(
                f"{where}: {tokens} tokens per page do not divide vLLM's block of {want} "
                f"(into {blocks} pages)"
            )
        token_axes = ((ratio, stride[0]), (tokens, stride[2]))  # kernel blocks of one block
        blocks, block_stride = blocks // ratio, stride[0] * ratio
    plane = Plane(content_start, content * itemsize, dtype, block_stride, stride[1], token_axes)
    return plane, blocks, heads


def _check_injective(where: str, axes: list[Axis]) -> None:
    """Each byte belongs to one (block, head, token, content) at most: every axis steps over
    everything the axes with smaller strides reach (sufficient, and what dense pages do)."""
    reach = 0
    for size, stride in sorted((a for a in axes if a[0] > 1), key=lambda a: a[1]):
        if stride <= 0:
            raise LayoutError(f"{where}: a non-positive stride (broadcast or reversed pages)")
        if stride <= reach:
            raise LayoutError(f"{where}: pages overlap (not a set of dense pages)")
        reach += (size - 1) * stride
    return None


def check_compatible(p: LayerLayout, d: LayerLayout) -> None:
    """P can write into D's layout: same block size, and the same planes holding the same
    slices of a token-head's content in the same dtypes. Strides (the physical layout), the
    number of blocks and of heads may differ.

    The content is opaque: backends order K and V inside it differently (FlashAttention puts
    a token's K then V, vLLM's CPU backend reuses a page's rows), so a single-tensor cache
    cannot be paired with separate K and V tensors by what the tensors say."""
    problems = []
    if p.block_size != d.block_size:
        problems.append(f"block size P {p.block_size} vs D {d.block_size}")
    if p.head_bytes != d.head_bytes:
        problems.append(f"bytes per token-head P {p.head_bytes} vs D {d.head_bytes}")
    split_p = [(x.content_start, x.content_bytes) for x in p.planes]
    split_d = [(x.content_start, x.content_bytes) for x in d.planes]
    if split_p != split_d:
        problems.append(f"planes (content start, bytes) P {split_p} vs D {split_d}")
    else:
        problems += [
            f"dtype of plane {i}: P {x.dtype} vs D {y.dtype}"
            for i, (x, y) in enumerate(zip(p.planes, d.planes, strict=True))
            if x.dtype != y.dtype
        ]
    if problems:
        raise LayoutError("KV layouts cannot be paired: " + "; ".join(problems))


def pair_pieces(
    p: LayerLayout,
    d: LayerLayout,
    pairs: Iterable[tuple[int, int]],
    p_heads: tuple[int, int],
    d_head_start: int,
) -> list[Piece]:
    """The runs copying P's heads ``p_heads`` (start, count) of each (P block, D block) pair
    into D's heads from ``d_head_start``, coalesced."""
    check_compatible(p, d)
    h0, count = p_heads
    if h0 < 0 or count < 1 or h0 + count > p.num_heads:
        raise LayoutError(f"P heads {h0}+{count} outside 0..{p.num_heads}")
    if d_head_start < 0 or d_head_start + count > d.num_heads:
        raise LayoutError(f"D heads {d_head_start}+{count} outside 0..{d.num_heads}")
    pairs = list(pairs)
    for pb, db in pairs:
        if not 0 <= pb < p.num_blocks:
            raise LayoutError(f"P block {pb} outside 0..{p.num_blocks - 1}")
        if not 0 <= db < d.num_blocks:
            raise LayoutError(f"D block {db} outside 0..{d.num_blocks - 1}")
    out: list[Piece] = []
    for plane, (sp, dp) in enumerate(zip(p.planes, d.planes, strict=True)):
        axes = [(count, sp.head_stride, dp.head_stride), *_refine(sp.token_axes, dp.token_axes)]
        runs = _runs(axes, sp.content_bytes, h0 * sp.head_stride, d_head_start * dp.head_stride)
        for pb, db in pairs:
            bs, bd = pb * sp.block_stride, db * dp.block_stride
            out.extend(Piece(plane, bs + s, bd + t, n) for s, t, n in runs)
    return coalesce(out)


def _refine(a: tuple[Axis, ...], b: tuple[Axis, ...]) -> list[tuple[int, int, int]]:
    """Token axes both sides can step together: ``(size, stride on a, stride on b)``."""
    ia, ib = list(reversed(a)), list(reversed(b))  # inner first
    out: list[tuple[int, int, int]] = []
    while ia and ib:
        (sa, ta), (sb, tb) = ia[0], ib[0]
        k = min(sa, sb)
        if sa % k or sb % k:
            raise LayoutError(f"token axes {a} and {b} do not nest")
        out.append((k, ta, tb))
        ia[0], ib[0] = (sa // k, ta * k), (sb // k, tb * k)
        if ia[0][0] == 1:
            ia.pop(0)
        if ib[0][0] == 1:
            ib.pop(0)
    if ia or ib:
        raise LayoutError(f"token axes {a} and {b} hold different numbers of tokens")
    return out[::-1]


def _runs(
    axes: list[tuple[int, int, int]], run: int, src0: int, dst0: int
) -> list[tuple[int, int, int]]:
    """``(src, dst, length)`` of one block: ``axes`` (size, src stride, dst stride) around a
    contiguous ``run``; the innermost axes contiguous on both sides fold into the run."""
    outer = sorted((a for a in axes if a[0] > 1), key=lambda a: -a[1])
    while outer and outer[-1][1] == run and outer[-1][2] == run:
        run *= outer.pop()[0]
    ranges = [range(size) for size, _, _ in outer]
    return [
        (
            src0 + sum(i * s for i, (_, s, _) in zip(idx, outer, strict=True)),
            dst0 + sum(i * t for i, (_, _, t) in zip(idx, outer, strict=True)),
            run,
        )
        for idx in itertools.product(*ranges)
    ]


def coalesce(pieces: list[Piece]) -> list[Piece]:
    """Merge pieces adjacent on both sides (consecutive blocks → one large write)."""
    out: list[Piece] = []
    for piece in sorted(pieces):
        if out:
            last = out[-1]
            if (
                last.plane == piece.plane
                and last.src + last.length == piece.src
                and last.dst + last.length == piece.dst
            ):
                out[-1] = last._replace(length=last.length + piece.length)
                continue
        out.append(piece)
    return out
