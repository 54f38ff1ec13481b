"""Optional end-to-end KV check (``verify_kv``): P signs what it pushed, D checks what landed.

P records every piece it wrote (D layer, source, destination, length) with a CRC32 of the
source at write time. With the done signal it sends, per piece, (D layer, destination, length,
CRC32 of the source *then*: after the prefill's last layer). A source that changed after it was
pushed (pushed before its KV was final, or its block reused) is logged on P; D recomputes each
CRC over its own memory before it reports the load complete, logs the first mismatching
(layer, blocks) and fails the load, so vLLM recomputes instead of decoding from wrong KV.

The bytes are read through the device seam (``Device.checksums``): host memory directly, CUDA
memory through one staging copy per batch of pieces; NPU memory cannot be read (``verify_kv``
is refused there at start). Cost: two CRC passes over the pushed bytes on P, one on D.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

from connector.device import Pieces, host_checksums
from connector.worker.memory import KVMemory


class Written(NamedTuple):
    """A piece P wrote, with the CRC32 of its source at write time."""

    layer: int  # D layer index
    src: int
    dst: int
    length: int
    crc: int


Digest = tuple[int, int, int, int]  # (``Signal.digests``) D layer index, dst addr, length, crc

Checksums = Callable[[Pieces], list[int]]


def sign(
    written: list[Written], checksums: Checksums = host_checksums
) -> tuple[list[Digest], list[Written]]:
    """(digests of the sources as they are now, pieces whose source changed since written)."""
    digests: list[Digest] = []
    changed: list[Written] = []
    nows = checksums([(w.src, w.length) for w in written])
    for w, now in zip(written, nows, strict=True):
        if now != w.crc:
            changed.append(w)
        digests.append((w.layer, w.dst, w.length, now))
    return digests, changed


def where(memory: KVMemory, layer: int, addr: int, length: int) -> str:
    """``layer NAME blocks a..b`` for a region of this instance's KV memory."""
    if not 0 <= layer < len(memory.layer_names):
        return f"layer #{layer} (unknown) at {addr:#x}+{length}"
    name = memory.layer_names[layer]
    lay = memory.layout(layer)
    for plane, base in enumerate(memory.bases[layer]):
        if base <= addr < base + lay.span(plane):
            first, head = lay.locate(plane, addr - base)
            last, _ = lay.locate(plane, addr + length - 1 - base)
            return f"layer {name} plane {plane} blocks {first}..{last} (from head {head})"
    return f"layer {name} at {addr:#x}+{length} (outside its planes)"


def check(memory: KVMemory, digests: list[Digest], checksums: Checksums = host_checksums) -> str:
    """``""`` when every digest matches this instance's memory, else the first mismatch."""
    regions = memory.regions()
    for layer, dst, n, _ in digests:
        if n <= 0 or not any(b <= dst and dst + n <= b + size for b, size in regions):
            return f"{dst:#x}+{n} (layer #{layer}) is outside this instance's KV memory"
    got_all = checksums([(dst, n) for _, dst, n, _ in digests])
    for (layer, dst, n, want), got in zip(digests, got_all, strict=True):
        if got != want:
            return f"{where(memory, layer, dst, n)}: crc32 {got:#010x}, P sent {want:#010x}"
    return ""
