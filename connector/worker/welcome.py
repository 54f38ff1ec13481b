"""D's answer to a P rank's handshake (``Hello``): this rank's KV memory map, or why not.

The ``Welcome`` names the rank's engine and epoch (new at every start: P redoes the handshake
with a restarted D), its place in its TP group, the transport session P writes into, and each
layer's base address and layout. A P of another protocol version is refused. The answer must
fit one side-channel frame (``wire.MAX_FRAME_BYTES``): ``check_fits`` refuses to start a rank
whose answer would not (its KV memory map: one entry per layer).

The worker half builds it once the KV caches are registered; ``answer`` runs on the
side-channel thread (``SideChannelServer``).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from connector import wire
from connector.errors import ConfigError
from connector.seal import OVERHEAD
from connector.transport import Transport
from connector.untrusted import shown
from connector.worker.memory import KVMemory
from pdwire.version import mismatch

log = logging.getLogger("pdgate.connector.worker")


@dataclass(frozen=True)
class Welcomer:
    engine_id: str
    epoch: str
    rank: int
    tp_size: int
    protocol: int  # what this rank speaks in its handshakes
    memory: KVMemory
    transport: Transport

    def check_fits(self) -> None:
        """D's handshake answer describes every layer: refuse to start rather than serve an
        answer no P would read (``wire.MAX_FRAME_BYTES``)."""
        size = len(wire.encode(self.answer(wire.Hello(self.engine_id, self.protocol)))) + OVERHEAD
        if size > wire.MAX_FRAME_BYTES:
            raise ConfigError(
                f"this engine's side-channel Welcome (its KV memory map: "
                f"{len(self.memory.layer_names)} layers) takes {size} "
                f"bytes, more than the {wire.MAX_FRAME_BYTES} a side-channel frame may"
            )

    def answer(self, hello: wire.Hello) -> wire.Welcome | wire.Refused:
        why = mismatch(hello.protocol, f"P engine {shown(hello.p_engine_id)}", self.protocol)
        if why is not None:
            log.warning("rank %d refuses a handshake: %s", self.rank, why)
            return wire.Refused(why, self.protocol)
        return wire.Welcome(
            engine_id=self.engine_id,
            epoch=self.epoch,
            tp_rank=self.rank,
            tp_size=self.tp_size,
            session=self.transport.session,
            layer_names=self.memory.layer_names,
            layer_bases=self.memory.bases,
            layouts=self.memory.layouts,
            layer_layouts=self.memory.layer_layout,
            protocol=self.protocol,
        )
