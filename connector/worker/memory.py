"""This rank's KV memory: per-layer tensors, their layout, plane base addresses, registration."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from connector.errors import LayoutError
from connector.layout import LayerLayout, describe
from connector.transport import Transport


def _planes(value: Any) -> list[Any]:
    return list(value) if isinstance(value, (list, tuple)) else [value]


def layout_kind(device: str, tensor: Any, num_planes: int) -> str:
    if num_planes > 1:
        return "npu"
    dims = tensor.dim()
    if dims == 3:
        return "mla"
    if dims == 5:
        return "flash"
    if dims == 4 and device == "cpu":
        return "cpu"
    raise LayoutError(f"no KV layout for a {dims}-d {device} cache of shape {tuple(tensor.shape)}")


@dataclass(frozen=True, slots=True)
class KVMemory:
    layer_names: list[str]
    bases: list[list[int]]  # per layer, per plane
    layout: LayerLayout

    @classmethod
    def of(cls, kv_caches: Mapping[str, Any], device: str) -> KVMemory:
        if not kv_caches:
            raise LayoutError("no KV caches to register")
        names = list(kv_caches)
        bases: list[list[int]] = []
        layout: LayerLayout | None = None
        for name in names:
            planes = _planes(kv_caches[name])
            first = planes[0]
            kind = layout_kind(device, first, len(planes))
            stride = 0
            if kind != "flash":
                stride = int(first.stride(0)) * first.element_size()
            this = describe(kind, tuple(first.shape), first.element_size(), len(planes), stride)
            if this.block_stride == this.block_bytes:
                this = describe(kind, tuple(first.shape), first.element_size(), len(planes))
            if kind == "flash":
                plane_bytes = this.num_blocks * this.block_bytes
                bases.append([first.data_ptr(), first.data_ptr() + plane_bytes])
            else:
                bases.append([p.data_ptr() for p in planes])
            for p in planes:
                dense = p.is_contiguous() if kind == "flash" else p[0].is_contiguous()
                if not dense:
                    raise LayoutError(f"KV cache blocks of {name} are not dense pages")
            if layout is not None and this != layout:
                raise LayoutError(f"layer {name} has layout {this}, others {layout}")
            layout = this
        assert layout is not None
        return cls(names, bases, layout)

    def regions(self) -> list[tuple[int, int]]:
        """Disjoint (ptr, length) memory regions covering every layer's blocks (layers that
        share KV alias one tensor; interleaved layers overlap and are merged)."""
        span = self.layout.span
        out: list[tuple[int, int]] = []
        for ptr in sorted({p for planes in self.bases for p in planes}):
            if out and ptr <= out[-1][0] + out[-1][1]:
                start, length = out[-1]
                out[-1] = (start, max(length, ptr + span - start))
            else:
                out.append((ptr, span))
        return out

    def register(self, transport: Transport) -> None:
        for ptr, length in self.regions():
            transport.register(ptr, length)

    def index(self) -> dict[str, int]:
        return {name: i for i, name in enumerate(self.layer_names)}


def same_layers(mine: Sequence[str], theirs: Sequence[str]) -> bool:
    return list(mine) == list(theirs)
