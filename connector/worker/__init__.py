"""Worker half of the connector (one per TP rank).

* ``ConnectorWorker`` (half.py) — the API vLLM calls on each rank; P's save path is
  ``PushSide`` (pushes.py), D's load path ``LoadSide`` (loads.py), D's handshake answer
  ``Welcomer`` (welcome.py).
* ``Sender`` (sender.py) — P: event-synchronised, coalesced, batched writes + done signals;
  its thread is loop.py, over batch.py (pieces → writes), writer.py (retried write),
  record.py (bytes, spans, signals), signing.py (digests), ledger.py / transfer.py (state).
* ``RecvTracker`` (receiver.py) — D: which requests wait for KV, what the polls report; over
  arrivals.py (signals, keep-alives, digests per transfer; early ones bounded) and
  verdict.py (how each load ends: deadlines, silence, digests checked).
* ``HandshakeCache`` (handshake.py), ``SideChannelServer`` (side_channel.py) — P ↔ D control.
* ``KVMemory`` (memory.py) — this rank's KV tensors, layout and registration.
"""

from __future__ import annotations

from connector.worker.half import ConnectorWorker

__all__ = ["ConnectorWorker"]
