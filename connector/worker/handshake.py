"""Handshakes with decode ranks: run in a background pool, cached, redone when D restarts.

Keyed by (host, port, engine id): a restarted D registers a new engine id, and a failed write
drops the entry, so the next transfer asks again. A failed handshake is remembered only for
``retry_after_s`` (the transfers in between fail fast), then asked again. Callers never block:
``get`` returns the ``Peer``, the error, or ``None`` while the handshake runs (``on_ready``
fires when it ends). ``check`` refuses a D whose KV this P cannot write (its error is the
handshake's, logged once per try).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

from connector import wire
from connector.errors import HandshakeError
from connector.stats import StatsCollector
from connector.worker.side_channel import handshake
from pdwire.version import PROTOCOL_VERSION

log = logging.getLogger("pdgate.connector.handshake")

Key = tuple[str, int, str]
Ask = Callable[[str, int, wire.Hello, float], wire.Welcome]


@dataclass(frozen=True, slots=True)
class Peer:
    """A D rank as the handshake described it, checked against this P."""

    welcome: wire.Welcome
    layer_index: dict[str, int]  # D's layer index of each layer name

    @classmethod
    def of(cls, welcome: wire.Welcome) -> Peer:
        return cls(welcome, {name: i for i, name in enumerate(welcome.layer_names)})


class HandshakeCache:
    def __init__(
        self,
        p_engine_id: str,
        timeout_s: float,
        on_ready: Callable[[], None],
        ask: Ask = handshake,
        check: Callable[[Peer, str], None] | None = None,
        protocol: int = PROTOCOL_VERSION,
        workers: int = 4,
        retry_after_s: float = 2.0,
        clock: Callable[[], float] = time.monotonic,
        stats: StatsCollector | None = None,
    ) -> None:
        self._stats = stats or StatsCollector()
        self._hello = wire.Hello(p_engine_id, protocol)
        self._timeout = timeout_s
        self._on_ready = on_ready
        self._ask = ask
        self._check = check
        self.retry_after_s = retry_after_s
        self._clock = clock
        self._failed_at: dict[Key, float] = {}
        self._pool = ThreadPoolExecutor(workers, thread_name_prefix="pdgate-handshake")
        self._lock = threading.Lock()
        self._done: dict[Key, Peer | Exception] = {}
        self._running: set[Key] = set()
        self.count = 0

    def get(self, host: str, port: int, engine_id: str) -> Peer | Exception | None:
        key = (host, port, engine_id)
        with self._lock:
            found = self._done.get(key)
            if isinstance(found, Exception):
                if self._clock() - self._failed_at.get(key, 0.0) >= self.retry_after_s:
                    del self._done[key]
                    found = None
            if found is not None or key in self._running:
                return found
            self._running.add(key)
        fut = self._pool.submit(self._ask, host, port, self._hello, self._timeout)
        fut.add_done_callback(lambda f: self._finish(key, f))
        return None

    def _finish(self, key: Key, fut: Future[wire.Welcome]) -> None:
        result: Peer | Exception
        try:
            welcome = fut.result()
            if welcome.engine_id != key[2]:
                raise HandshakeError(
                    f"{key[0]}:{key[1]} is engine {welcome.engine_id}, binding says {key[2]}"
                )
            result = Peer.of(welcome)
            if self._check is not None:
                self._check(result, key[0])
        except Exception as exc:
            result = exc
        if isinstance(result, Exception):
            log.warning("handshake with %s:%d failed: %s", key[0], key[1], result)
        self._stats.add("handshakes", label="failed" if isinstance(result, Exception) else "ok")
        with self._lock:
            self._running.discard(key)
            self._done[key] = result
            if isinstance(result, Exception):
                self._failed_at[key] = self._clock()
            self.count += 1
        self._on_ready()

    def forget(self, host: str, port: int, engine_id: str) -> None:
        with self._lock:
            self._done.pop((host, port, engine_id), None)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
