"""Scheduler half of the connector (runs in vLLM's EngineCore process).

* ``ConnectorScheduler`` (half.py) — the API vLLM calls; owns the metaserver plumbing.
* ``DecodeSide`` (decode.py) — D: async load + binding publication.
* ``PrefillSide`` (prefill.py) — P: per-chunk block ranges, delay-free bookkeeping; over
  admission.py (whether P pushes: trust, pairing, the lease) and pushes.py (per-request
  state, each step's chunk).
* ``Lookups`` (lookups.py) — background binding fetches and registry checks.
* ``Registrar`` (registrar.py) — instance registration + heartbeat.
"""

from __future__ import annotations

from connector.scheduler.half import ConnectorScheduler

__all__ = ["ConnectorScheduler"]
