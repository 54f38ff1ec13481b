"""This rank's KV memory: each layer's layout read from its tensors, plane base addresses, and
the regions the transport registers.

What ``register_kv_caches`` receives, per layer name:

* a tensor ``[B, H, N, C]`` — vLLM's per-layer view (0.32 and later, every platform);
* a tuple of tensors ``[B, N, H, D]`` — vllm-ascend's separate K and V (or MLA's latent and
  rope parts, DSA's indexer), whose contents are concatenated in that order;
* a 3-d tensor is read as ``[B, N, C]``: one head (a latent cache).

Anything else is refused here with the layer's name, shape and strides: a raw buffer (a layer
vLLM gives no per-layer view, e.g. a state-space layer), a list (vllm-ascend's Mamba states and
DeepSeek-V4's compressed caches), a 5-d cache of an older vLLM, pages that overlap.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from connector.errors import LayoutError
from connector.layout import LayerLayout, Plane, plane_of
from connector.transport import Transport


def _where(name: str, tensor: Any) -> str:
    return f"layer {name}: shape {tuple(tensor.shape)} strides {tuple(tensor.stride())}"


def describe_layer(name: str, value: Any, block_size: int | None) -> tuple[LayerLayout, list[int]]:
    """A layer's layout and its planes' base addresses. ``block_size``: vLLM's block (tokens);
    ``None`` takes the tensors' own."""
    if isinstance(value, list):
        shapes = ", ".join(str(tuple(t.shape)) for t in value)
        raise LayoutError(
            f"layer {name}: a list of {len(value)} state tensors ({shapes}): vllm-ascend hands "
            "lists for Mamba / linear-attention states and DeepSeek-V4's compressed caches, "
            "which pdgate cannot transfer"
        )
    split = isinstance(value, tuple)
    tensors = list(value) if split else [value]
    if not tensors:
        raise LayoutError(f"layer {name}: no KV tensors")
    planes: list[Plane] = []
    bases: list[int] = []
    shape: tuple[int, int] | None = None
    start = 0
    for i, t in enumerate(tensors):
        what = f"layer {name}" + (f" part {i}" if split else "")
        dims = t.dim()
        order = {4: "BNHC" if split else "BHNC", 3: "BNC"}.get(dims)
        if order is None:
            hint = " (a raw buffer: a layer with no per-layer KV view, e.g. a state-space layer)"
            hint = hint if dims == 1 else " (5-d caches are the layout of vLLM before 0.32)"
            raise LayoutError(f"{_where(name, t)}: cannot describe a {dims}-d KV cache{hint}")
        dtype = str(t.dtype).removeprefix("torch.")
        plane, blocks, heads = plane_of(
            what,
            tuple(t.shape),
            tuple(t.stride()),
            t.element_size(),
            dtype,
            order,
            block_size,
            start,
        )
        if shape is not None and (blocks, heads) != shape:
            raise LayoutError(
                f"{what}: {blocks} blocks x {heads} heads, but the layer's first part has "
                f"{shape[0]} x {shape[1]}"
            )
        shape = (blocks, heads)
        start += plane.content_bytes
        planes.append(plane)
        bases.append(int(t.data_ptr()))
    assert shape is not None
    tokens = 1
    for size, _ in planes[0].token_axes:
        tokens *= size
    return LayerLayout(shape[0], shape[1], tokens, tuple(planes)), bases


@dataclass(frozen=True, slots=True)
class KVMemory:
    layer_names: list[str]
    bases: list[list[int]]  # per layer, per plane: absolute address
    layouts: list[LayerLayout]  # the distinct layouts
    layer_layout: list[int]  # per layer: its index in ``layouts``

    @classmethod
    def of(cls, kv_caches: Mapping[str, Any], block_size: int | None = None) -> KVMemory:
        if not kv_caches:
            raise LayoutError("no KV caches to register")
        layouts: dict[LayerLayout, int] = {}
        bases: list[list[int]] = []
        which: list[int] = []
        for name, value in kv_caches.items():
            layout, addrs = describe_layer(name, value, block_size)
            which.append(layouts.setdefault(layout, len(layouts)))
            bases.append(addrs)
        return cls(list(kv_caches), bases, list(layouts), which)

    def layout(self, layer: int) -> LayerLayout:
        return self.layouts[self.layer_layout[layer]]

    @property
    def block_bytes(self) -> int:
        """The most bytes one block of one layer holds."""
        return max(lay.block_bytes for lay in self.layouts)

    @property
    def bytes_per_block(self) -> int:
        """Bytes one block holds over all layers (what a push of one whole block moves)."""
        return sum(self.layout(layer).block_bytes for layer in range(len(self.layer_names)))

    def regions(self) -> list[tuple[int, int]]:
        """Disjoint (ptr, length) memory regions covering every layer's planes (layers that
        share KV alias one tensor; interleaved layers overlap and are merged)."""
        spans = sorted(
            (base, base + self.layout(layer).span(plane))
            for layer, planes in enumerate(self.bases)
            for plane, base in enumerate(planes)
        )
        out: list[list[int]] = []
        for start, end in spans:
            if out and start <= out[-1][1]:
                out[-1][1] = max(out[-1][1], end)
            else:
                out.append([start, end])
        return [(start, end - start) for start, end in out]

    def register(self, transport: Transport) -> None:
        for ptr, length in self.regions():
            transport.register(ptr, length)

    def index(self) -> dict[str, int]:
        return {name: i for i, name in enumerate(self.layer_names)}

    def summary(self) -> str:
        return "; ".join(
            f"{sum(1 for w in self.layer_layout if w == i)} layer(s): {lay.describe()}"
            for i, lay in enumerate(self.layouts)
        )


def same_layers(mine: Sequence[str], theirs: Sequence[str]) -> bool:
    return list(mine) == list(theirs)
