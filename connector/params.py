"""``kv_transfer_params`` of a request, parsed once into typed objects.

Decode side:  ``{"do_remote_prefill": true, "transfer_id": tid, "metaserver": url}``
Prefill side: ``{"do_remote_decode": true, "transfer_id": tid, "metaserver": url,
"decode": <Binding JSON>}`` ("decode" absent in concurrent mode: P fetches the binding).
The per-request "metaserver" field is informational only: engines use their configured URL.
P's answer: ``{"transfer_id": tid, "push": "started" | "none", "reason": ...}`` (``push_report``).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from pydantic import ValidationError

from connector.errors import ParamsError
from metaserver.models import Binding

TRANSFER_ID_RE = re.compile(r"^[A-Za-z0-9._:-]{1,128}$")


@dataclass(frozen=True, slots=True)
class RecvParams:
    transfer_id: str


@dataclass(frozen=True, slots=True)
class SendParams:
    transfer_id: str
    binding: Binding | None


def _tid(params: dict[str, Any]) -> str:
    tid = params.get("transfer_id")
    if not isinstance(tid, str) or not TRANSFER_ID_RE.match(tid):
        raise ParamsError(f"kv_transfer_params.transfer_id must match {TRANSFER_ID_RE.pattern}")
    return tid


def parse_recv(params: dict[str, Any] | None) -> RecvParams | None:
    """Params asking this (decode) instance to receive a remote prefill, else ``None``."""
    if not params or params.get("do_remote_prefill") is not True:
        return None
    if "transfer_id" not in params:
        return None  # prefill-first / pull-connector params: not ours
    return RecvParams(_tid(params))


def parse_send(params: dict[str, Any] | None) -> SendParams | None:
    """Params asking this (prefill) instance to push to a decode instance, else ``None``."""
    if not params or params.get("do_remote_decode") is not True or "transfer_id" not in params:
        return None
    tid = _tid(params)
    raw = params.get("decode")
    if raw is None:
        return SendParams(tid, None)
    try:
        binding = Binding.model_validate(raw)
    except ValidationError as exc:
        raise ParamsError(f"kv_transfer_params.decode is not a binding: {exc}") from exc
    if binding.transfer_id != tid:
        raise ParamsError("kv_transfer_params.decode belongs to another transfer_id")
    return SendParams(tid, binding)


def push_report(transfer_id: str | None, no_push_reason: str | None) -> dict[str, Any]:
    """What P's answer carries in ``kv_transfer_params``: ``push`` is ``"started"`` or
    ``"none"`` (then with a ``reason``). A push that started and then failed tells D itself (a
    failed signal); ``"none"`` means D hears nothing, so the proxy lets D compute the prompt
    itself rather than wait for its load deadline."""
    report: dict[str, Any] = {"transfer_id": transfer_id}
    if no_push_reason is None:
        report["push"] = "started"
    else:
        report["push"] = "none"
        report["reason"] = no_push_reason
    return report
