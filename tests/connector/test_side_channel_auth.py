"""The side channel with a deployment secret (``connector/seal.py``): D takes only sealed,
fresh, first-seen frames, and P only D's sealed answer to its own question.

Each attack below was first run against the unauthenticated channel (``OPEN``, the default
without a secret), where it succeeds: a forged ``done`` signal for a transfer D waits for is
taken (D would decode from blocks nobody wrote), and anyone's ``Hello`` is answered with D's
memory map. With a secret they are dropped and counted, and sealed traffic around them is
served."""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest
import zmq
from hypothesis import given, settings
from hypothesis import strategies as st

from connector import wire
from connector.config import ConnectorSettings
from connector.errors import HandshakeError
from connector.seal import (
    MAX_SKEW_S,
    NO_REPLY,
    OPEN,
    OVERHEAD,
    Sealer,
    Unsealed,
    channel_of,
)
from connector.worker.side_channel import SideChannelServer, SignalClient, handshake
from pdservice.keys import load_keys
from tests.support.procs import free_port, until

KEY = b"k" * 32
OLD_KEY = b"o" * 32
WELCOME = wire.Welcome("d-engine", "epoch", 0, 1, "session", ["l0"], [[4096]], [], [0])


class Clock:
    def __init__(self, now: float = 1_000_000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def _signal(tid: str) -> bytes:
    return wire.encode(wire.Signal(tid, "p/0", True, 1))


# ---- the sealing itself -------------------------------------------------------------------


def test_a_sealed_frame_opens_once_and_only_unchanged() -> None:
    clock = Clock()
    p, d = Sealer([KEY], clock=clock), Sealer([KEY], clock=clock)
    frame, nonce = p.seal(b"payload")
    assert len(frame) == OVERHEAD + len(b"payload")
    opened = d.open(frame)
    assert (opened.payload, opened.nonce) == (b"payload", nonce)
    with pytest.raises(Unsealed) as replay:
        d.open(frame)
    assert replay.value.reason == "replayed"
    frame2, _ = p.seal(b"payload")
    flipped = frame2[:-1] + bytes([frame2[-1] ^ 1])
    with pytest.raises(Unsealed) as tampered:
        d.open(flipped)
    assert tampered.value.reason == "bad_mac"
    with pytest.raises(Unsealed) as bare:
        d.open(b"payload")
    assert bare.value.reason == "unsealed"
    with pytest.raises(Unsealed) as foreign:
        d.open(Sealer([b"x" * 32], clock=clock).seal(b"payload")[0])
    assert foreign.value.reason == "unknown_key"


def test_a_frame_from_outside_the_clock_window_is_refused() -> None:
    sender_clock, receiver_clock = Clock(), Clock()
    p = Sealer([KEY], clock=sender_clock)
    d = Sealer([KEY], clock=receiver_clock)
    old, _ = p.seal(b"x")
    receiver_clock.now += MAX_SKEW_S + 1  # a capture replayed after the window
    with pytest.raises(Unsealed) as stale:
        d.open(old)
    assert stale.value.reason == "stale"
    sender_clock.now = receiver_clock.now + MAX_SKEW_S - 1  # skewed, but within the window
    assert d.open(p.seal(b"y")[0]).payload == b"y"


def test_a_reply_opens_only_as_the_answer_to_its_question() -> None:
    p, d = Sealer([KEY]), Sealer([KEY])
    _, asked = p.seal(b"hello")
    answer, _ = d.seal(b"welcome", reply_to=asked)
    _, other = p.seal(b"hello again")
    with pytest.raises(Unsealed) as wrong:
        p.open(answer, reply_to=other)  # an old Welcome replayed to a new Hello
    assert wrong.value.reason == "not_our_reply"
    assert p.open(answer, reply_to=asked).payload == b"welcome"
    with pytest.raises(Unsealed):
        d.open(d.seal(b"welcome", reply_to=asked)[0])  # a reply is not a question


def test_rotation_opens_with_either_key_and_seals_with_the_first(tmp_path: Path) -> None:
    rotating = tmp_path / "secret"
    rotating.write_bytes(KEY + b"\n" + OLD_KEY + b"\n")
    d = channel_of(str(rotating))
    assert d.open(Sealer([OLD_KEY]).seal(b"from an old P")[0]).payload == b"from an old P"
    assert Sealer([KEY]).open(d.seal(b"from D")[0]).payload == b"from D"
    with pytest.raises(Unsealed):
        Sealer([OLD_KEY]).open(d.seal(b"from D")[0])


def test_secret_files_that_cannot_work_fail_at_start_with_the_reason(tmp_path: Path) -> None:
    short = tmp_path / "short"
    short.write_text("tooshort\n")
    empty = tmp_path / "empty"
    empty.write_text("\n  \n")
    with pytest.raises(ValueError, match="shorter than 16 bytes"):
        load_keys(short)
    with pytest.raises(ValueError, match="holds no key"):
        load_keys(empty)
    with pytest.raises(ValueError, match="No such file"):
        load_keys(tmp_path / "missing")
    with pytest.raises(ValueError, match="side_channel_secret_file"):
        ConnectorSettings(side_channel_secret_file=str(short))
    assert channel_of("") is OPEN


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=400))
def test_any_bytes_are_refused_or_opened_never_crash(frame: bytes) -> None:
    """The decoder fuzzed: D's side of a sealed channel and the message decoder behind it."""
    d = Sealer([KEY])
    try:
        payload = d.open(frame).payload
    except Unsealed:
        return
    raise AssertionError(f"random bytes opened: {payload!r}")  # pragma: no cover


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=400))
def test_any_sealed_payload_decodes_or_raises_a_decode_error(payload: bytes) -> None:
    """What a holder of the key could send: the payload decoder never fails another way."""
    d, p = Sealer([KEY]), Sealer([KEY])
    opened = d.open(p.seal(payload)[0])
    try:
        wire.decode(opened.payload)
    except (ValueError, TypeError):  # msgspec's DecodeError and ValidationError are these
        pass


# ---- a D rank's real side channel -----------------------------------------------------------


@dataclass
class Rank:
    server: SideChannelServer
    signals: list[wire.Signal]
    port: int


@pytest.fixture
def sealed_d() -> Iterator[Rank]:
    signals: list[wire.Signal] = []
    port = free_port()
    server = SideChannelServer(
        "127.0.0.1", port, lambda hello: WELCOME, signals.append, channel=Sealer([KEY])
    )
    try:
        yield Rank(server, signals, port)
    finally:
        server.close()


def _raw_sender(port: int) -> tuple[zmq.Context[zmq.Socket[bytes]], zmq.Socket[bytes]]:
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(f"tcp://127.0.0.1:{port}")
    return ctx, sock


def test_d_drops_forged_and_replayed_signals_and_takes_sealed_ones(sealed_d: Rank) -> None:
    ctx, forger = _raw_sender(sealed_d.port)
    p = SignalClient(Sealer([KEY]))
    try:
        forger.send(_signal("victim-transfer"))  # a forged "done": taken without a secret
        sealed, _ = Sealer([KEY]).seal(_signal("t-1"))
        forger.send(sealed)
        forger.send(sealed)  # the same frame captured and sent again
        forger.send(Sealer([b"z" * 32]).seal(_signal("t-2"))[0])  # another deployment's key
        p.send("127.0.0.1", sealed_d.port, wire.Signal("t-3", "p/0", True, 1))
        # two sockets: which of the two sealed signals D reads first is not fixed
        until(lambda: sorted(s.transfer_id for s in sealed_d.signals) == ["t-1", "t-3"])
        until(lambda: sum(sealed_d.server.rejected.values()) == 3)
        assert sealed_d.server.rejected == {"unsealed": 1, "replayed": 1, "unknown_key": 1}
    finally:
        p.close()
        forger.close(0)
        ctx.term()


def test_only_a_sealed_hello_gets_d_s_memory_map(sealed_d: Rank) -> None:
    hello = wire.Hello("p-engine", WELCOME.protocol)
    with pytest.raises(HandshakeError, match="no handshake answer"):
        handshake("127.0.0.1", sealed_d.port, hello, 1.0)  # unsealed: no answer at all
    assert sealed_d.server.rejected == {"unsealed": 1}
    got = handshake("127.0.0.1", sealed_d.port, hello, 5.0, channel=Sealer([KEY]))
    assert got == WELCOME


def test_p_refuses_a_welcome_it_cannot_authenticate() -> None:
    """Whoever answers on D's port without D's secret (a bare Welcome, one sealed with another
    key, or a replay of D's own earlier answer) is not taken for D."""
    port = free_port()
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    router = ctx.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    router.bind(f"tcp://127.0.0.1:{port}")
    d = Sealer([KEY])
    earlier, _ = d.seal(wire.encode(WELCOME), reply_to=b"q" * 16)  # D's answer to another Hello
    answers = [
        wire.encode(WELCOME),
        Sealer([b"i" * 32]).seal(wire.encode(WELCOME), reply_to=NO_REPLY)[0],
        earlier,
    ]
    pool = ThreadPoolExecutor(1)
    try:
        for answer in answers:
            asked = pool.submit(
                handshake, "127.0.0.1", port, wire.Hello("p", WELCOME.protocol), 5.0, Sealer([KEY])
            )
            ident, _question = router.recv_multipart()
            router.send_multipart([ident, answer])
            with pytest.raises(HandshakeError, match="answered the handshake unauthenticated"):
                asked.result(10)
    finally:
        pool.shutdown()
        router.close(0)
        ctx.term()
