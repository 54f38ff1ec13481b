"""A transport between threads of one process (tests): copies into registered regions.

Every write is bounds-checked against the regions both sides registered, so a wrong offset
fails loudly instead of corrupting memory. ``fail_writes_to`` injects faults. Host memory is
copied with ``memmove``; device memory needs a ``copy`` that can reach it (the GPU scripts
pass a CUDA copy engine), which must return only once the bytes are in place.
"""

from __future__ import annotations

import ctypes
import itertools
import threading
from collections.abc import Callable

from connector.errors import TransferError

_REGISTRY: dict[str, InProcessTransport] = {}
_LOCK = threading.Lock()
_IDS = itertools.count()

Copy = Callable[[list[int], list[int], list[int]], None]  # sources, destinations, lengths


def memmove(src: list[int], dst: list[int], lengths: list[int]) -> None:
    for s, d, n in zip(src, dst, lengths, strict=True):
        ctypes.memmove(d, s, n)


class InProcessTransport:
    def __init__(self, copy: Copy = memmove, host: str = "127.0.0.1") -> None:
        self._copy = copy
        self.host = host  # the machine it stands for (as Mooncake's session names one)
        self._session = f"inprocess:{next(_IDS)}"
        self._regions: list[tuple[int, int]] = []
        self.fail_writes_to: set[str] = set()
        self.bytes_written = 0
        self.calls = 0
        with _LOCK:
            _REGISTRY[self._session] = self

    @property
    def session(self) -> str:
        return self._session

    def session_problem(self, session: str, host: str) -> str | None:
        peer = _REGISTRY.get(session)
        if peer is not None and peer.host == host:
            return None
        return f"D at {host} names session {session!r}, not one on {host}"

    @property
    def lands_on_completion(self) -> bool:
        return True  # memmove

    @property
    def late_landing_s(self) -> float:
        return 0.0  # a failed memmove batch has stopped for good

    def register(self, ptr: int, length: int) -> None:
        self._regions.append((ptr, length))

    def _inside(self, ptr: int, length: int) -> bool:
        return any(base <= ptr and ptr + length <= base + n for base, n in self._regions)

    def write(self, session: str, src: list[int], dst: list[int], lengths: list[int]) -> None:
        with _LOCK:
            peer = _REGISTRY.get(session)
        if peer is None or session in self.fail_writes_to:
            raise TransferError(f"in-process peer {session} unreachable")
        self.calls += 1
        for s, d, n in zip(src, dst, lengths, strict=True):
            if not self._inside(s, n):
                raise TransferError(f"source {s:#x}+{n} not in registered memory")
            if not peer._inside(d, n):
                raise TransferError(f"destination {d:#x}+{n} not in {session}'s registered memory")
        self._copy(src, dst, lengths)
        self.bytes_written += sum(lengths)

    def close(self) -> None:
        with _LOCK:
            _REGISTRY.pop(self._session, None)
