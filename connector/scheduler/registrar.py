"""Registers this vLLM instance in the metaserver and keeps it alive (a small daemon thread).

Bindings that point at an unregistered instance, or at another KV endpoint, are refused by
the metaserver, and prefill instances push only into registered decoders.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from pdwire.client import MetaserverClient
from pdwire.models import InstanceSpec

log = logging.getLogger("pdgate.connector.registrar")


class Registrar:
    def __init__(
        self,
        client: MetaserverClient,
        instance_id: str,
        spec: InstanceSpec,
        interval_s: float,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._client = client
        self._clock = clock
        self.lapses = 0  # beats that landed after the registration had already expired
        self.instance_id = instance_id
        self.spec = spec
        self._interval = interval_s
        self._stop = threading.Event()
        self.registered = threading.Event()
        self.beats = 0
        self._thread = threading.Thread(target=self._run, name="pdgate-registrar", daemon=True)

    def start(self) -> Registrar:
        self._thread.start()
        return self

    def _run(self) -> None:
        last_ok: float | None = None
        while not self._stop.is_set():
            try:
                self._client.put_instance(self.instance_id, self.spec)
                now = self._clock()
                if not self.registered.is_set():
                    log.info("registered %s in the metaserver as %s", self.instance_id, self.spec)
                elif last_ok is not None and now - last_ok > (self.spec.ttl_s or float("inf")):
                    self.lapses += 1
                    log.warning(
                        "heartbeat of %s landed %.1fs after the previous one (registration TTL "
                        "%.0fs): the registry had forgotten this instance meanwhile",
                        self.instance_id,
                        now - last_ok,
                        self.spec.ttl_s,
                    )
                last_ok = now
                self.registered.set()
                self.beats += 1
            except Exception as exc:
                log.warning("heartbeat of %s failed: %s", self.instance_id, exc)
            self._stop.wait(self._interval)

    def close(self, deregister: bool = True) -> None:
        self._stop.set()
        self._thread.join(5.0)
        if deregister and self.registered.is_set():
            try:
                self._client.delete_instance(self.instance_id)
            except Exception as exc:
                log.info("deregistering %s failed: %s", self.instance_id, exc)
        self._client.close()
