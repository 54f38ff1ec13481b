"""The device seam: events that mark "this layer's KV is written", per accelerator.

``cpu``: the attention op has finished writing when ``save_kv_layer`` runs (CPU ops are
synchronous in the forward thread), so events are already complete. ``cuda`` / ``npu``: a real
device event recorded on the current stream; the sender waits on that event only, never on a
whole-stream synchronize. ``torch_npu`` is imported only when ``device="npu"``.
"""

from __future__ import annotations

from typing import Any, Protocol


class Event(Protocol):
    def synchronize(self) -> None: ...


class Device(Protocol):
    name: str

    def record_event(self) -> Event: ...


class _Done:
    def synchronize(self) -> None:
        return None


_DONE = _Done()


class CpuDevice:
    name = "cpu"

    def record_event(self) -> Event:
        return _DONE


class _TorchDevice:
    def __init__(self, name: str, module: Any) -> None:
        self.name = name
        self._module = module

    def record_event(self) -> Event:
        event: Event = self._module.Event()
        event.record()  # type: ignore[attr-defined]
        return event


def make_device(name: str) -> Device:
    if name == "cpu":
        return CpuDevice()
    import torch

    if name == "cuda":
        return _TorchDevice("cuda", torch.cuda)
    import torch_npu  # type: ignore[import-not-found]  # noqa: F401  (registers torch.npu)

    return _TorchDevice("npu", torch.npu)  # type: ignore[attr-defined]
