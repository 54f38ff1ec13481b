"""Mooncake transfer engine (``mooncake-transfer-engine``): tcp here, rdma / ascend in production.

Peers are addressed as ``host:rpc_port`` (P2P handshake mode: no etcd/metadata server).
"""

from __future__ import annotations

import logging
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
        self._lock = threading.Lock()
        log.info("mooncake transfer engine up at %s (%s)", self._session, protocol)

    @property
    def session(self) -> str:
        return self._session

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
