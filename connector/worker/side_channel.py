"""The direct P ↔ D side channel (ZeroMQ): D serves handshakes and receives done signals.

D rank r binds a ROUTER socket on ``side_channel_port + r``. P asks for the handshake from a
pool thread (own socket, timeout) and sends signals from its sender thread through one DEALER
per D rank (fire-and-forget; ZeroMQ queues while connecting). With a side-channel secret every
frame is sealed and checked (``connector/seal.py``); D drops what does not open, by reason.
Every socket, on either side, reads no frame over ``wire.MAX_FRAME_BYTES``.
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

from connector import wire
from connector.errors import HandshakeError
from connector.seal import OPEN, Channel, Unsealed
from connector.untrusted import shown
from pdwire.version import mismatch

log = logging.getLogger("pdgate.connector.side_channel")


def _zmq() -> Any:
    import zmq

    return zmq


def _socket(ctx: Any, kind: int) -> Any:
    """A socket that reads no frame over the cap (ZeroMQ drops a peer that sends one)."""
    sock = ctx.socket(kind)
    sock.setsockopt(_zmq().MAXMSGSIZE, wire.MAX_FRAME_BYTES)
    return sock


def _host(host: str) -> str:
    return f"[{host}]" if ":" in host and not host.startswith("[") else host


class SideChannelServer:
    """D rank's ROUTER socket: answers ``Hello`` with ``make_welcome()``, hands ``Signal``,
    ``Digests`` and ``Alive`` on."""

    def __init__(
        self,
        host: str,
        port: int,
        make_welcome: Callable[[wire.Hello], wire.Welcome | wire.Refused],
        on_signal: Callable[[wire.Signal], None],
        on_alive: Callable[[wire.Alive], None] | None = None,
        channel: Channel = OPEN,
        on_digests: Callable[[wire.Digests], None] | None = None,
    ) -> None:
        zmq = _zmq()
        self._ctx = zmq.Context()
        self._sock = _socket(self._ctx, zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 0)
        bind_host = "*" if host in ("0.0.0.0", "") else _host(host)
        self._sock.bind(f"tcp://{bind_host}:{port}")
        self.port = port
        self._welcome = make_welcome
        self._on_signal = on_signal
        self._on_alive = on_alive
        self._on_digests = on_digests
        self._channel = channel
        self._stop = threading.Event()
        self.bad_messages = 0
        self.rejected: dict[str, int] = {}  # frames that did not open, by reason
        self._thread = threading.Thread(target=self._run, name=f"pdgate-side-{port}", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        zmq = _zmq()
        poller = zmq.Poller()
        poller.register(self._sock, zmq.POLLIN)
        while not self._stop.is_set():
            if not dict(poller.poll(100)):
                continue
            frames = self._sock.recv_multipart()
            if len(frames) < 2:
                continue
            ident, frame = frames[0], frames[-1]
            try:
                opened = self._channel.open(frame)
            except Unsealed as exc:
                self._reject(exc)
                continue
            try:
                msg = wire.decode(opened.payload)
            except Exception:
                self.bad_messages += 1
                continue
            if isinstance(msg, wire.Hello):
                try:
                    reply: wire.Message = self._welcome(msg)
                except Exception as exc:
                    reply = wire.Refused(str(exc)[: wire.MAX_ERROR_CHARS])
                sealed, _ = self._channel.seal(wire.encode(reply), reply_to=opened.nonce)
                self._sock.send_multipart([ident, sealed])
            elif isinstance(msg, wire.Signal):
                try:
                    self._on_signal(msg)
                except Exception:
                    log.exception("signal handler failed")
            elif isinstance(msg, wire.Digests):
                if self._on_digests is not None:
                    self._on_digests(msg)
            elif isinstance(msg, wire.Alive):
                if self._on_alive is not None:
                    self._on_alive(msg)
            else:
                self.bad_messages += 1
        self._sock.close(0)
        self._ctx.term()

    def _reject(self, exc: Unsealed) -> None:
        """Count a frame that did not open; log the first of each reason and every 1000th."""
        n = self.rejected[exc.reason] = self.rejected.get(exc.reason, 0) + 1
        if n == 1 or n % 1000 == 0:
            log.warning(
                "side channel :%d dropped a frame (%s); %d so far for that reason",
                self.port,
                exc,
                n,
            )

    def close(self) -> None:
        self._stop.set()
        self._thread.join(2.0)


def handshake(
    host: str, port: int, hello: wire.Hello, timeout_s: float, channel: Channel = OPEN
) -> wire.Welcome:
    """Ask D rank at ``host:port`` for its KV description (blocking; run it off-thread). A
    port that refuses connections fails at once: ZeroMQ would keep reconnecting quietly
    until ``timeout_s``. With a sealing ``channel`` only D's sealed answer to this very
    question is taken."""
    started = time.monotonic()
    if refuses(host, port, min(1.0, timeout_s)):
        raise HandshakeError(f"{host}:{port} refuses connections (no D side channel there)")
    left_s = max(0.0, timeout_s - (time.monotonic() - started))
    zmq = _zmq()
    ctx = zmq.Context.instance()
    sock = _socket(ctx, zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        sock.connect(f"tcp://{_host(host)}:{port}")
        question, nonce = channel.seal(wire.encode(hello))
        sock.send(question)
        if not sock.poll(int(left_s * 1000)):
            hint = " (a D with another side-channel secret, or none, drops the question)"
            raise HandshakeError(f"no handshake answer from {host}:{port} in {timeout_s}s{hint}")
        frame = sock.recv()
    finally:
        sock.close(0)
    try:
        raw = channel.open(frame, reply_to=nonce).payload
    except Unsealed as exc:
        what = f"{host}:{port} answered the handshake unauthenticated: {exc}"
        raise HandshakeError(what) from None
    kind, version = wire.protocol_of(raw)
    if kind == "welcome" and (why := mismatch(version, f"D at {host}:{port}", hello.protocol)):
        raise HandshakeError(why)  # checked first: another release's Welcome may not decode
    msg = wire.decode(raw)
    if isinstance(msg, wire.Refused):
        raise HandshakeError(f"{host}:{port} refused the handshake: {shown(msg.reason)}")
    if not isinstance(msg, wire.Welcome):
        raise HandshakeError(f"{host}:{port} answered the handshake with {type(msg).__name__}")
    return msg


def refuses(host: str, port: int, timeout_s: float = 1.0) -> bool:
    """Whether nothing listens on D rank's side channel at ``host:port``: the connection is
    refused, so that D process is gone (a D that restarts comes back with a new engine id and
    new KV memory). A timeout or any other error says nothing: ``False``."""
    try:
        with socket.create_connection((host, port), timeout=timeout_s):
            return False
    except ConnectionRefusedError:
        return True
    except OSError:
        return False


class SignalClient:
    """Done/failed signals and keep-alives to D ranks (use from one thread: ZeroMQ sockets are
    not shared)."""

    def __init__(self, channel: Channel = OPEN) -> None:
        zmq = _zmq()
        self._ctx = zmq.Context.instance()
        self._socks: dict[tuple[str, int], Any] = {}
        self._channel = channel

    def send(self, host: str, port: int, signal: wire.Signal | wire.Digests | wire.Alive) -> bool:
        zmq = _zmq()
        sock = self._socks.get((host, port))
        if sock is None:
            sock = _socket(self._ctx, zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 1000)
            sock.connect(f"tcp://{_host(host)}:{port}")
            self._socks[(host, port)] = sock
        try:
            sock.send(self._channel.seal(wire.encode(signal))[0], zmq.NOBLOCK)
            return True
        except zmq.Again:
            what = (
                f"{len(signal.transfer_ids)} transfers"
                if isinstance(signal, wire.Alive)
                else signal.transfer_id
            )
            kind = type(signal).__name__
            log.warning("signal queue to %s:%d full; dropped a %s (%s)", host, port, kind, what)
            return False

    def close(self) -> None:
        for sock in self._socks.values():
            sock.close()
        self._socks.clear()
