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


class MooncakeTransport:
    def __init__(self, host: str, protocol: str, device_name: str) -> None:
        try:
            from mooncake.engine import TransferEngine
        except ImportError as exc:  # pragma: no cover - depends on the install
            raise ConfigError(
                "transport 'mooncake' needs mooncake-transfer-engine (and libibverbs1)"
            ) from exc
        self._engine: Any = TransferEngine()
        rc = self._engine.initialize(host, "P2PHANDSHAKE", protocol, device_name)
        if rc != 0:
            raise ConfigError(f"mooncake initialize({host}, {protocol}, {device_name!r}) -> {rc}")
        self._session = f"{host}:{self._engine.get_rpc_port()}"
        # rdma / ascend complete once the bytes are placed; so does tcp's default acknowledged
        # protocol, but not the old one (MC_TCP_PROTO=1), which completes on send
        self._lands = protocol != "tcp" or os.environ.get("MC_TCP_PROTO", "").strip() != "1"
        self._lock = threading.Lock()
        log.info("mooncake transfer engine up at %s (%s)", self._session, protocol)

    @property
    def session(self) -> str:
        return self._session

    @property
    def lands_on_completion(self) -> bool:
        return self._lands

    def register(self, ptr: int, length: int) -> None:
        rc = self._engine.register_memory(ptr, length)
        if rc != 0:
            raise TransferError(f"mooncake register_memory({ptr:#x}, {length}) -> {rc}")

    def write(self, session: str, src: list[int], dst: list[int], lengths: list[int]) -> None:
        rc = self._engine.batch_transfer_sync_write(session, src, dst, lengths)
        if rc != 0:
            raise TransferError(f"mooncake write to {session} failed ({rc})")

    def close(self) -> None:
        self._engine = None
