"""The device seam: events that mark "this layer's KV is written", per accelerator.

``cpu``: the attention op has finished writing when ``save_kv_layer`` runs (CPU ops are
synchronous in the forward thread), so events are already complete. ``cuda`` / ``npu``: a real
device event recorded on the current stream; the sender waits on that event only, never on a
whole-stream synchronize, and first writes the layers whose events have completed (a device
forward is ahead of its kernels: many layers are queued before the first is computed).
``torch_npu`` is imported only when ``device="npu"``. ``checksums`` reads device memory for
``verify_kv``: host memory directly, CUDA memory through a staging copy; NPU: refused.
"""

from __future__ import annotations

import ctypes
import threading
import zlib
from collections.abc import Sequence
from typing import Any, Protocol

from connector.errors import ConfigError

Pieces = Sequence[tuple[int, int]]  # (address, length) of this process's memory


class Event(Protocol):
    def synchronize(self) -> None: ...

    def query(self) -> bool:
        """Whether the work recorded before the event has finished (never waits)."""
        ...


class Device(Protocol):
    name: str

    def record_event(self) -> Event: ...

    def checksums(self, pieces: Pieces) -> list[int]:
        """crc32 of each piece of this device's memory (``verify_kv``); raises ``ConfigError``
        where the device's memory cannot be read."""
        ...


def host_checksums(pieces: Pieces) -> list[int]:
    return [zlib.crc32((ctypes.c_char * n).from_address(addr)) for addr, n in pieces]


class _Done:
    def synchronize(self) -> None:
        return None

    def query(self) -> bool:
        return True


_DONE = _Done()


class CpuDevice:
    name = "cpu"

    def record_event(self) -> Event:
        return _DONE

    def checksums(self, pieces: Pieces) -> list[int]:
        return host_checksums(pieces)


class _CudaBytes:
    """``length`` bytes of device memory at ``addr``, for ``torch.as_tensor`` (no copy)."""

    def __init__(self, addr: int, length: int) -> None:
        self.__cuda_array_interface__ = {
            "shape": (length,),
            "typestr": "|u1",
            "data": (addr, False),
            "version": 3,
        }


class _TorchDevice:
    def __init__(self, name: str, module: Any) -> None:
        self.name = name
        self._module = module
        self._streams = threading.local()

    def record_event(self) -> Event:
        event: Event = self._module.Event()
        event.record()  # type: ignore[attr-defined]
        return event

    def checksums(self, pieces: Pieces) -> list[int]:
        """CUDA: the pieces gathered on the device and copied to the host in one staging
        copy, on a stream of the calling thread's own (the forward's is never waited on)."""
        if self.name != "cuda":
            raise ConfigError(f"verify_kv cannot read {self.name} memory (no digest support)")
        if not pieces:
            return []
        import torch

        stream = getattr(self._streams, "stream", None)
        if stream is None:
            stream = self._streams.stream = torch.cuda.Stream()  # type: ignore[no-untyped-call]
        out: list[int] = []
        for batch in _batches(pieces, STAGING_BYTES):
            with torch.cuda.stream(stream):
                parts = [torch.as_tensor(_CudaBytes(a, n), device="cuda") for a, n in batch]
                staged = torch.cat(parts).cpu()
            data = memoryview(staged.numpy().tobytes())
            offset = 0
            for _, n in batch:
                out.append(zlib.crc32(data[offset : offset + n]))
                offset += n
        return out


STAGING_BYTES = 64 << 20  # device memory read for digests at a time


def _batches(pieces: Pieces, limit: int) -> list[list[tuple[int, int]]]:
    out: list[list[tuple[int, int]]] = [[]]
    size = 0
    for addr, n in pieces:
        if out[-1] and size + n > limit:
            out.append([])
            size = 0
        out[-1].append((addr, n))
        size += n
    return out


def make_device(name: str) -> Device:
    if name == "cpu":
        return CpuDevice()
    import torch

    if name == "cuda":
        return _TorchDevice("cuda", torch.cuda)
    import torch_npu  # type: ignore[import-not-found]  # noqa: F401  (registers torch.npu)

    return _TorchDevice("npu", torch.npu)  # type: ignore[attr-defined]
