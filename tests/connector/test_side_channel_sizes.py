"""Every side-channel socket reads frames of a few MiB at most, and every legitimate message
fits: digests that do not fit in a done signal go ahead of it in ``Digests`` messages.

The cap used to be 256 MiB, on D's socket only: a peer could make D (or P, answering its
handshake) buffer a quarter GiB per frame, and a 2.7 MB ``Alive`` already cost D a second per
step (review 2, N1)."""

from __future__ import annotations

import itertools
import threading
from collections.abc import Iterator
from typing import Any

import pytest
import torch
import zmq

from connector import wire
from connector.errors import ConfigError, HandshakeError
from connector.seal import OVERHEAD, Sealer
from connector.transport import InProcessTransport
from connector.worker import ConnectorWorker
from connector.worker.side_channel import SideChannelServer, SignalClient, handshake
from pdwire.version import PROTOCOL_VERSION
from tests.connector import cluster as C
from tests.support.procs import free_port
from tests.support.sealing import key_file

FEW_MIB = 4 << 20
TID = "t" * 128  # the longest transfer id
SENDER = "e" * 120 + "/1023"
_tid = itertools.count()


def _largest_messages() -> dict[str, wire.Message]:
    biggest: wire.Digest = (65_535, 2**64 - 1, 2**64 - 1, 2**32 - 1)
    digests = [biggest] * wire.MAX_DIGESTS_PER_MESSAGE
    return {
        "signal": wire.Signal(
            TID, SENDER, False, 1024, "x" * 1024, digests, wire.MAX_SETTLE_S, "p" * 128,
            wire.MAX_DIGESTS_PER_SENDER,
        ),
        "digests": wire.Digests(TID, SENDER, digests),
        "alive": wire.Alive(SENDER, [TID] * 4096),
    }  # fmt: skip


def test_the_cap_is_a_few_mib_and_every_legit_message_fits() -> None:
    assert wire.MAX_FRAME_BYTES <= FEW_MIB
    for name, msg in _largest_messages().items():
        size = len(wire.encode(msg)) + OVERHEAD  # sealed
        assert size <= wire.MAX_FRAME_BYTES, (name, size)


def test_every_side_channel_socket_reads_no_frame_over_the_cap() -> None:
    port = free_port()
    server = SideChannelServer("127.0.0.1", port, lambda h: wire.Refused("no"), lambda s: None)
    client = SignalClient()
    try:
        assert server._sock.getsockopt(zmq.MAXMSGSIZE) == wire.MAX_FRAME_BYTES
        client.send("127.0.0.1", port, wire.Alive("p/0", ["t"]))
        (sock,) = client._socks.values()  # P's signal socket: D could answer on it
        assert sock.getsockopt(zmq.MAXMSGSIZE) == wire.MAX_FRAME_BYTES
    finally:
        client.close()
        server.close()


@pytest.fixture
def huge_welcome_d() -> Iterator[int]:
    """A "D" that answers every question with a valid Welcome over the cap."""
    port = free_port()
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    router = ctx.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    router.bind(f"tcp://127.0.0.1:{port}")
    names = [f"layer-{i}-{'n' * 1000}" for i in range(FEW_MIB // 1000 + 1)]
    huge = wire.Welcome("d", "e", 0, 1, "s", names, [[0]] * len(names), [], [0] * len(names),
                        PROTOCOL_VERSION)  # fmt: skip
    stop = threading.Event()

    def answer() -> None:
        while not stop.is_set():
            if router.poll(50):
                ident, _ = router.recv_multipart()
                router.send_multipart([ident, wire.encode(huge)])

    thread = threading.Thread(target=answer, daemon=True)
    thread.start()
    try:
        yield port
    finally:
        stop.set()
        thread.join()
        router.close(0)
        ctx.term()


def test_p_takes_no_welcome_over_the_cap(huge_welcome_d: int) -> None:
    hello = wire.Hello("p-engine", PROTOCOL_VERSION)
    with pytest.raises(HandshakeError, match="no handshake answer"):
        handshake("127.0.0.1", huge_welcome_d, hello, 2.0)


def test_d_refuses_to_start_when_its_welcome_would_not_fit() -> None:
    w = ConnectorWorker(
        None,
        wire_settings(),
        rank=0,
        tp_size=1,
        engine_id="d-engine",
        role="kv_consumer",
        transport=InProcessTransport(),
    )
    layers = {f"layer-{i}-{'n' * 1000}": torch.zeros(2, 1, 4, 8) for i in range(4200)}
    try:
        with pytest.raises(ConfigError, match="Welcome"):
            w.register_kv_caches(layers)
    finally:
        w.shutdown()


def wire_settings() -> Any:
    from connector.config import ConnectorSettings

    return ConnectorSettings(transport="inprocess", side_channel_secret_file=key_file())


# ---- digests in several messages ------------------------------------------------------------


class Recorded(SignalClient):
    """P's signal socket, recording what it sends (``drop``: the kinds never sent)."""

    sent: list[str] = []
    drop: tuple[type, ...] = ()

    def send(self, host: str, port: int, signal: Any) -> bool:
        Recorded.sent.append(type(signal).__name__)
        if isinstance(signal, Recorded.drop):
            Recorded.drop = ()  # only the first
            return True  # "sent": lost on the way
        return super().send(host, port, signal)


def _push_with_digests(
    monkeypatch: pytest.MonkeyPatch, drop: tuple[type, ...] = ()
) -> tuple[C.Instance, C.Instance, set[str]]:
    monkeypatch.setenv("PDGATE_CONNECTOR_VERIFY_KV", "1")
    monkeypatch.setenv("PDGATE_CONNECTOR_LANDING_WAIT_S", "0.3")
    monkeypatch.setattr(wire, "MAX_DIGESTS_PER_MESSAGE", 3)  # P splits after 3
    monkeypatch.setattr("connector.worker.record.SignalClient", Recorded)
    Recorded.sent, Recorded.drop = [], drop
    port = C.free_port_range(1)
    d = C.make_instance("d-eng", "kv_consumer", 1, port=port)
    p = C.make_instance("p-eng", "kv_producer", 1)
    C.fill_prefill(p, seed=5)
    tid = f"s{next(_tid)}"
    pairs = [(0, 9), (1, 10), (2, 11), (5, 3)]
    C.expect(d, "dreq", tid, [b for _, b in pairs])
    C.push(p, "preq", tid, C.destination(d, port), [pairs[:2], pairs[2:]])
    got = C.poll(d, set(), lambda acc: "dreq" in acc[0][1])
    return p, d, got[0][2]


def test_digests_that_do_not_fit_one_signal_go_ahead_and_are_all_checked(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    p, d, failed = _push_with_digests(monkeypatch)
    try:
        assert failed == set() and d.workers[0].tracker.verified == 1
        sender = p.workers[0].sender
        assert sender is not None
        pieces = len(sender.transfers["preq"][0].written)  # 3 per layer: 12
        assert pieces > 2 * 3
        # all but the last 3 in messages of 3 ahead of the signal, on one connection
        assert Recorded.sent.count("Digests") == -(-pieces // 3) - 1
        assert Recorded.sent[-1] == "Signal"
    finally:
        C.close(p, d)


def test_a_load_whose_digests_did_not_all_arrive_fails(monkeypatch: pytest.MonkeyPatch) -> None:
    p, d, failed = _push_with_digests(monkeypatch, drop=(wire.Digests,))
    try:
        assert failed == {"dreq"} and d.workers[0].tracker.verified == 0
    finally:
        C.close(p, d)


def test_sealed_digests_reach_d_like_signals() -> None:
    got: list[wire.Digests] = []
    port = free_port()
    key = b"k" * 32
    server = SideChannelServer(
        "127.0.0.1", port, lambda h: wire.Refused("no"), lambda s: None,
        on_digests=got.append, channel=Sealer([key]),
    )  # fmt: skip
    client = SignalClient(Sealer([key]))
    try:
        client.send("127.0.0.1", port, wire.Digests("t", "p/0", [(0, 4096, 64, 7)]))
        deadline = threading.Event()
        for _ in range(200):
            if got:
                break
            deadline.wait(0.025)
        assert got == [wire.Digests("t", "p/0", [(0, 4096, 64, 7)])]
    finally:
        client.close()
        server.close()
