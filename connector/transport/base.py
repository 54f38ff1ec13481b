"""The transport interface and its factory (``import mooncake`` happens only when chosen)."""

from __future__ import annotations

from typing import Protocol


class Transport(Protocol):
    @property
    def session(self) -> str:
        """Address peers pass to ``write`` to reach this process's registered memory."""
        ...

    @property
    def lands_on_completion(self) -> bool:
        """Whether a finished ``write`` means the bytes are in the peer's memory. Mooncake's old
        tcp protocol (``MC_TCP_PROTO=1``) finishes once the bytes are handed to the socket; the
        peer's receive thread applies them later, so a done signal on another connection can
        overtake them."""
        ...

    @property
    def late_landing_s(self) -> float:
        """How long pieces of a write that *failed* may still land in the peer's memory. A
        Mooncake write that hits its deadline is abandoned, not cancelled: its pieces sit in a
        stalled connection and are applied when the receiver reads them, at the latest when
        the connection is dropped for lack of progress (one more deadline)."""
        ...

    def session_problem(self, session: str, host: str) -> str | None:
        """Why a D reached at ``host`` may not name ``session`` as its memory (None: it may).
        A Welcome naming another process's session would have P write into that process."""
        ...

    def register(self, ptr: int, length: int) -> None: ...

    def write(self, session: str, src: list[int], dst: list[int], lengths: list[int]) -> None:
        """Copy ``lengths[i]`` bytes local ``src[i]`` → peer ``dst[i]``; raise TransferError."""
        ...

    def close(self) -> None: ...


def make_transport(
    kind: str,
    host: str,
    protocol: str,
    device_name: str,
    write_timeout_s: int = 10,
) -> Transport:
    if kind == "inprocess":
        from connector.transport.inprocess import InProcessTransport

        return InProcessTransport()
    from connector.transport.mooncake import MooncakeTransport

    return MooncakeTransport(host, protocol, device_name, write_timeout_s)
