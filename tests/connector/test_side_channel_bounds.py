"""D's side channel reads bounded messages only: a Signal that would hold D's blocks forever,
or a frame too large to buffer, is dropped and counted, and the channel goes on serving."""

from __future__ import annotations

from collections.abc import Iterator

import msgspec
import pytest
import zmq

from connector import wire
from connector.worker.side_channel import SideChannelServer
from tests.support.procs import free_port, until


class Heard:
    def __init__(self) -> None:
        self.signals: list[wire.Signal] = []


@pytest.fixture
def d_rank() -> Iterator[tuple[SideChannelServer, Heard, zmq.Socket[bytes]]]:
    heard = Heard()
    port = free_port()
    server = SideChannelServer(
        "127.0.0.1", port, lambda hello: wire.Refused("not in this test"), heard.signals.append
    )
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(f"tcp://127.0.0.1:{port}")
    try:
        yield server, heard, sock
    finally:
        sock.close(0)
        ctx.term()
        server.close()


def _signal(tid: str, settle_s: float) -> bytes:
    # encoded by hand: P's own encoder would refuse nothing, a forger's need not be ours
    raw = {"type": "signal", "transfer_id": tid, "sender": "p/0", "ok": True, "expected": 1}
    return msgspec.msgpack.encode(raw | {"settle_s": settle_s})


def test_a_signal_that_would_hold_blocks_forever_is_dropped(
    d_rank: tuple[SideChannelServer, Heard, zmq.Socket[bytes]],
) -> None:
    # before: settle_s=1e12 was taken as is, and D kept the transfer's blocks out of use
    server, heard, sock = d_rank
    sock.send(_signal("forged-1", 1e12))
    sock.send(_signal("t-2", wire.MAX_SETTLE_S))
    until(lambda: len(heard.signals) == 1)
    assert [s.transfer_id for s in heard.signals] == ["t-2"]
    assert server.bad_messages == 1
    with pytest.raises(msgspec.ValidationError):
        wire.decode(_signal("x", -1.0))


def test_a_frame_over_the_limit_is_refused_and_the_channel_serves_on(
    d_rank: tuple[SideChannelServer, Heard, zmq.Socket[bytes]],
) -> None:
    _, heard, sock = d_rank
    sock.send(b"\0" * (wire.MAX_FRAME_BYTES + 1))
    # ZeroMQ drops the connection on the oversized frame; the DEALER reconnects by itself
    sock.send(_signal("t-3", 0.0))
    until(lambda: [s.transfer_id for s in heard.signals] == ["t-3"], limit_s=10.0)
