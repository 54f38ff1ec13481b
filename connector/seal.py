"""Side-channel authentication: every P ↔ D message sealed with the deployment's secret.

With ``side_channel_secret_file`` set, each frame is ``header + tag + payload``:

    version (1) | key id (4) | sent_at (8, float64 seconds since the epoch) | nonce (16)
    | reply_to (16) | HMAC-SHA256(key, header + payload) (32) | payload (msgpack, ``wire``)

A receiver drops (and counts, by reason) a frame that is not sealed, names a key it does not
hold, fails the MAC, was sent more than ``max_skew_s`` from its own clock, or repeats a nonce
it has seen within that window (a replay); D's answer to a ``Hello`` carries the Hello's nonce
in ``reply_to``, so P accepts only the answer to the question it asked. The file holds one key
per line: the first seals, every one opens (rotation: add the new key second everywhere, then
move it first, then drop the old one). Without the setting frames are the bare payload and
nothing is checked (``OPEN``): the side channel is then as trusted as the network it runs on.

The MAC authenticates, it does not encrypt: what a ``Welcome`` says about D's memory is still
readable on the wire. The KV bytes themselves travel over the transport (Mooncake), which has
no authentication of its own; see docs/security.md.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import struct
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from pdservice.keys import load_keys

VERSION = 1
_HEADER = struct.Struct(">B4sd16s16s")  # version, key id, sent_at, nonce, reply_to
TAG_BYTES = 32
OVERHEAD = _HEADER.size + TAG_BYTES
NO_REPLY = bytes(16)
MAX_SKEW_S = 60.0  # a frame this far from the receiver's clock is refused (clocks need NTP)


class Unsealed(Exception):
    """A frame that must be dropped; ``reason`` is a short label for counting."""

    def __init__(self, reason: str, detail: str = "") -> None:
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason


@dataclass(frozen=True)
class Opened:
    payload: bytes
    nonce: bytes  # the sender's nonce (what a reply names in ``reply_to``)


def key_id(key: bytes) -> bytes:
    return hashlib.sha256(b"pdgate side channel key id\0" + key).digest()[:4]


class ReplayGuard:
    """Nonces seen within the skew window (a frame older than that is refused anyway)."""

    def __init__(self, window_s: float) -> None:
        self._window = window_s
        self._seen: dict[bytes, float] = {}
        self._lock = threading.Lock()
        self._next_prune = 0.0

    def first_time(self, nonce: bytes, now: float) -> bool:
        with self._lock:
            if now >= self._next_prune:
                self._seen = {n: t for n, t in self._seen.items() if t > now}
                self._next_prune = now + self._window / 4
            if nonce in self._seen:
                return False
            self._seen[nonce] = now + 2 * self._window
            return True

    def __len__(self) -> int:
        return len(self._seen)


class Sealer:
    """Seals frames with the first key, opens frames sealed with any of ``keys``."""

    authenticated = True

    def __init__(
        self,
        keys: Sequence[bytes],
        *,
        max_skew_s: float = MAX_SKEW_S,
        clock: Callable[[], float] = time.time,
        nonces: Callable[[], bytes] = lambda: os.urandom(16),
    ) -> None:
        if not keys:
            raise ValueError("a sealer needs at least one key")
        self._seal_key = keys[0]
        self._seal_id = key_id(keys[0])
        self._keys = {key_id(k): k for k in keys}
        self._skew = max_skew_s
        self._clock = clock
        self._nonces = nonces
        self._replays = ReplayGuard(max_skew_s)

    def seal(self, payload: bytes, reply_to: bytes = NO_REPLY) -> tuple[bytes, bytes]:
        """The frame for ``payload``, and its nonce."""
        nonce = self._nonces()
        header = _HEADER.pack(VERSION, self._seal_id, self._clock(), nonce, reply_to)
        return header + _tag(self._seal_key, header, payload) + payload, nonce

    def open(self, frame: bytes, reply_to: bytes | None = None) -> Opened:
        """``frame``'s payload, or ``Unsealed``. ``reply_to``: the nonce the frame must answer
        (a handshake's reply); ``None``: it must answer nothing."""
        if len(frame) < OVERHEAD or frame[0] != VERSION:
            raise Unsealed("unsealed", "not a sealed frame (is the sender's secret set?)")
        version, kid, sent_at, nonce, answers = _HEADER.unpack_from(frame)
        key = self._keys.get(kid)
        if key is None:
            raise Unsealed("unknown_key", f"sealed with key id {kid.hex()}, not one of ours")
        view = memoryview(frame)
        payload = view[OVERHEAD:]
        want = _tag(key, view[: _HEADER.size], payload)
        if not hmac.compare_digest(view[_HEADER.size : OVERHEAD], want):
            raise Unsealed("bad_mac", "the frame's MAC does not match its content")
        now = self._clock()
        if not abs(now - sent_at) <= self._skew:  # (also refuses a NaN)
            raise Unsealed("stale", f"sent {now - sent_at:.1f}s from this clock")
        if answers != (reply_to if reply_to is not None else NO_REPLY):
            raise Unsealed("not_our_reply", "answers another request")
        if not self._replays.first_time(nonce, now):
            raise Unsealed("replayed", "nonce seen before")
        return Opened(bytes(payload), nonce)


def _tag(key: bytes, header: bytes | memoryview, payload: bytes | memoryview) -> bytes:
    mac = hmac.new(key, header, hashlib.sha256)
    mac.update(payload)
    return mac.digest()


class OpenChannel:
    """No secret: frames are the bare payload, nothing is checked."""

    authenticated = False

    def seal(self, payload: bytes, reply_to: bytes = NO_REPLY) -> tuple[bytes, bytes]:
        return payload, NO_REPLY

    def open(self, frame: bytes, reply_to: bytes | None = None) -> Opened:
        return Opened(frame, NO_REPLY)


Channel = Sealer | OpenChannel
OPEN = OpenChannel()


def channel_of(secret_file: str, max_skew_s: float = MAX_SKEW_S) -> Channel:
    """The side channel's sealing for ``side_channel_secret_file`` ('' = none)."""
    return Sealer(load_keys(secret_file), max_skew_s=max_skew_s) if secret_file else OPEN
