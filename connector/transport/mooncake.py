"""Mooncake transfer engine (``mooncake-transfer-engine``): tcp here, rdma / ascend in production.

Peers are addressed as ``host:rpc_port`` (P2P handshake mode: no etcd/metadata server).
"""

from __future__ import annotations

import logging
import os
import threading
from typing import Any

from connector.errors import ConfigError, TransferError

log = logging.getLogger("pdgate.connector.mooncake")

# Deadlines the engine reads from its environment when it is constructed. Mooncake's own
# default for all three is 30 s, and a tcp write whose lane stalls (seen here with two P ranks
# writing one D on a loaded 2-core machine) waits all of it; failing sooner lets the sender
# retry. MC_TRANSFER_TIMEOUT bounds batch_transfer_sync_write (minimum 5); the tcp ones fail a
# lane that makes no progress or gets no acknowledgement, so it reconnects instead of staying
# stuck behind the retried write.
DEADLINE_ENV = ("MC_TRANSFER_TIMEOUT", "MC_TCP_PROGRESS_TIMEOUT_SEC", "MC_TCP_STATUS_TIMEOUT_SEC")

# Mooncake's tcp transport queues at most MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER slices (default
# 1024) per peer; beyond that a slice waits briefly for admission and is then rejected, and
# the whole batch fails at once with -1 ("TCP lane queue-full rejection" in its log). A push
# into D's ranks of a head-split layout (P tp 1 into D tp 2, token-major blocks) is thousands
# of 128-byte pieces. So tcp writes go to a peer one batch at a time from this process, each
# at most half the queue (the other half: another process writing the same peer).
QUEUE_ENV, QUEUE_DEFAULT = "MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER", 1024
SLICE_ENV, SLICE_DEFAULT = "MC_TCP_SLICE_SIZE", 64 * 1024


def _env_int(name: str, default: int) -> int:
    raw = os.environ.get(name, "").strip()
    try:
        value = int(raw) if raw else default
    except ValueError:
        return default
    return value if value > 0 else default


def batches(lengths: list[int], slice_bytes: int, max_slices: int) -> list[range]:
    """Consecutive index ranges over ``lengths``, each at most ``max_slices`` slices of
    ``slice_bytes`` (a piece longer than a slice counts as several; a piece larger than the
    whole allowance goes alone)."""
    out: list[range] = []
    start, used = 0, 0
    for i, n in enumerate(lengths):
        cost = max(1, -(-n // slice_bytes))
        if i > start and used + cost > max_slices:
            out.append(range(start, i))
            start, used = i, 0
        used += cost
    if start < len(lengths):
        out.append(range(start, len(lengths)))
    return out


def late_landing_s(write_s: float, lane_s: float) -> float:
    """How long after it failed (or its sender froze) a write may still land: the write deadline,
    then up to the longest lane deadline before the lane is dropped, plus 2 s."""
    return write_s + lane_s + 2.0


def set_deadlines(write_timeout_s: int) -> dict[str, str]:
    """Set each deadline the environment does not already set (an operator's value wins)."""
    for name in DEADLINE_ENV:
        if not os.environ.get(name, "").strip():
            os.environ[name] = str(write_timeout_s)
    return {name: os.environ[name] for name in DEADLINE_ENV}


def session_problem(session: str, host: str) -> str | None:
    """A Mooncake session is ``<host the engine was started with>:<rpc port>``, and the
    connector starts it with its side-channel host: D's session must be on the host P reached
    D's side channel at. (Engines sharing one host are not told apart.)"""
    named, sep, port = session.rpartition(":")
    if sep and port.isdigit() and named.strip("[]") == host.strip("[]"):
        return None
    return f"D at {host} names Mooncake session {session!r}, not one on {host}"


class MooncakeTransport:
    def __init__(
        self,
        host: str,
        protocol: str,
        device_name: str,
        write_timeout_s: int = 10,
    ) -> None:
        try:
            from mooncake.engine import TransferEngine
        except ImportError as exc:  # pragma: no cover - depends on the install
            raise ConfigError(
                "transport 'mooncake' needs mooncake-transfer-engine (and libibverbs1)"
            ) from exc
        knobs = set_deadlines(write_timeout_s)
        self._engine: Any = TransferEngine()
        rc = self._engine.initialize(host, "P2PHANDSHAKE", protocol, device_name)
        if rc != 0:
            raise ConfigError(f"mooncake initialize({host}, {protocol}, {device_name!r}) -> {rc}")
        self._session = f"{host}:{self._engine.get_rpc_port()}"
        # rdma / ascend complete once the bytes are placed; so does tcp's default acknowledged
        # protocol, but not the old one (MC_TCP_PROTO=1), which completes on send
        self._lands = protocol != "tcp" or os.environ.get("MC_TCP_PROTO", "").strip() != "1"
        # a write abandoned at MC_TRANSFER_TIMEOUT can sit in its lane until the progress or
        # acknowledgement deadline drops the connection; the receiver then applies what it had
        # buffered (operators may set the three apart, so take the longest lane deadline)
        lane_s = max(float(knobs[k]) for k in DEADLINE_ENV[1:])
        self._late_s = late_landing_s(float(knobs["MC_TRANSFER_TIMEOUT"]), lane_s)
        self._lock = threading.Lock()
        self._peers: dict[str, threading.Lock] = {}  # tcp: one batch at a time per peer
        self._tcp = protocol == "tcp"
        self._slice = _env_int(SLICE_ENV, SLICE_DEFAULT)
        self._max_slices = max(1, _env_int(QUEUE_ENV, QUEUE_DEFAULT) // 2)
        log.info(
            "mooncake transfer engine up at %s (%s; %s)",
            self._session,
            protocol,
            ", ".join(f"{k}={v}" for k, v in knobs.items()),
        )

    @property
    def session(self) -> str:
        return self._session

    def session_problem(self, session: str, host: str) -> str | None:
        return session_problem(session, host)

    @property
    def lands_on_completion(self) -> bool:
        return self._lands

    @property
    def late_landing_s(self) -> float:
        return self._late_s

    def register(self, ptr: int, length: int) -> None:
        rc = self._engine.register_memory(ptr, length)
        if rc != 0:
            raise TransferError(f"mooncake register_memory({ptr:#x}, {length}) -> {rc}")

    def write(self, session: str, src: list[int], dst: list[int], lengths: list[int]) -> None:
        if not self._tcp:
            self._write(session, src, dst, lengths)
            return
        with self._lock:
            peer = self._peers.setdefault(session, threading.Lock())
        with peer:
            for r in batches(lengths, self._slice, self._max_slices):
                lo, hi = r.start, r.stop
                self._write(session, src[lo:hi], dst[lo:hi], lengths[lo:hi])

    def _write(self, session: str, src: list[int], dst: list[int], lengths: list[int]) -> None:
        rc = self._engine.batch_transfer_sync_write(session, src, dst, lengths)
        if rc != 0:
            raise TransferError(f"mooncake write to {session} failed ({rc})")

    def close(self) -> None:
        self._engine = None
