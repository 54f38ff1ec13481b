"""``kv_transfer_params`` of each leg, each direction: one builder and one parser per message.

proxy → D   ``decode_leg``:  ``{"do_remote_prefill": true, "transfer_id": T, "metaserver": URL}``
            parsed on D by ``parse_decode_leg``
proxy → P   ``prefill_leg``: ``{"do_remote_decode": true, "transfer_id": T, "metaserver": URL,
            "decode": <the binding JSON>, "decode_instance": <D's id>}`` ("decode" absent in
            concurrent mode: P fetches it; "decode_instance" absent when the proxy's registry
            does not know the chosen D's id) parsed on P by ``parse_prefill_leg``
P → proxy   ``push_report`` in P's answer: ``{"transfer_id": T, "push": "started" | "none",
            "reason": ...}``, parsed by the proxy with ``parse_push_report``
proxy → P   ``pull_prefill_leg`` (prefill-first, vLLM's pull connectors): ``{"do_remote_decode":
            true, "do_remote_prefill": false, "remote_*": null}``; P's answer goes to D as it
            came (vLLM's own connector parses both)

With tracing on, both legs carry ``"traceparent"``: the W3C context of the proxy's span for
that leg (``pdwire.trace``), so the connector's spans join the request's trace; a malformed
one is dropped by the parsers, never an error.

The "metaserver" field is informational: engines use the metaserver URL of their own
configuration. The proxy embeds D's binding as the raw bytes the metaserver sent
(``msgspec.Raw``): nothing is parsed and dumped again per request.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import msgspec
from pydantic import ValidationError

from pdwire.errors import ParamsError
from pdwire.ids import INSTANCE_ID_PATTERN, TRANSFER_ID_PATTERN, valid_id
from pdwire.models import Binding
from pdwire.trace import TRACEPARENT, TraceParent, parse_traceparent


@dataclass(frozen=True, slots=True)
class RecvParams:
    """D: receive this transfer's KV from a remote prefill."""

    transfer_id: str
    trace: TraceParent | None = None  # the proxy's decode-leg span (tracing on)


@dataclass(frozen=True, slots=True)
class SendParams:
    """P: push this transfer's KV to the decode instance of ``binding`` (``None``: fetch it)."""

    transfer_id: str
    binding: Binding | None
    trace: TraceParent | None = None  # the proxy's prefill-leg span (tracing on)
    decode_instance: str | None = None  # the D the proxy chose: a binding naming another is refused


def decode_leg(transfer_id: str, metaserver: str, traceparent: str | None = None) -> dict[str, Any]:
    params: dict[str, Any] = {
        "do_remote_prefill": True,
        "transfer_id": transfer_id,
        "metaserver": metaserver,
    }
    if traceparent is not None:
        params[TRACEPARENT] = traceparent
    return params


def prefill_leg(
    transfer_id: str,
    metaserver: str,
    binding: msgspec.Raw | dict[str, Any] | None = None,
    traceparent: str | None = None,
    decode_instance: str | None = None,
) -> dict[str, Any]:
    params: dict[str, Any] = {
        "do_remote_decode": True,
        "transfer_id": transfer_id,
        "metaserver": metaserver,
    }
    if binding is not None:
        params["decode"] = binding
    if decode_instance is not None:
        params["decode_instance"] = decode_instance
    if traceparent is not None:
        params[TRACEPARENT] = traceparent
    return params


def pull_prefill_leg() -> dict[str, Any]:
    """P's params in the prefill-first flow: compute the prompt, keep the KV for D to pull."""
    return {
        "do_remote_decode": True,
        "do_remote_prefill": False,
        "remote_engine_id": None,
        "remote_block_ids": None,
        "remote_host": None,
        "remote_port": None,
    }


def _object(params: object) -> None:
    """vLLM passes whatever JSON value a client put there (through ``vllm_xargs`` too)."""
    if params is not None and not isinstance(params, dict):
        raise ParamsError(f"kv_transfer_params must be an object, not {type(params).__name__}")


def _tid(params: dict[str, Any]) -> str:
    tid = params.get("transfer_id")
    if not valid_id(tid):
        raise ParamsError(f"kv_transfer_params.transfer_id must match {TRANSFER_ID_PATTERN}")
    assert isinstance(tid, str)
    return tid


def parse_decode_leg(params: dict[str, Any] | None) -> RecvParams | None:
    """Params asking this (decode) instance to receive a remote prefill, else ``None`` (no
    params, or another connector's: prefill-first's pull params have no ``transfer_id``)."""
    _object(params)
    if not params or params.get("do_remote_prefill") is not True:
        return None
    if "transfer_id" not in params:
        return None
    return RecvParams(_tid(params), _trace(params))


def parse_prefill_leg(params: dict[str, Any] | None) -> SendParams | None:
    """Params asking this (prefill) instance to push to a decode instance, else ``None``."""
    _object(params)
    if not params or params.get("do_remote_decode") is not True or "transfer_id" not in params:
        return None
    tid = _tid(params)
    chosen = params.get("decode_instance")
    if chosen is not None and not valid_id(chosen):
        raise ParamsError(f"kv_transfer_params.decode_instance must match {INSTANCE_ID_PATTERN}")
    raw = params.get("decode")
    if raw is None:
        return SendParams(tid, None, _trace(params), chosen)
    try:
        binding = Binding.model_validate(raw)
    except ValidationError as exc:
        raise ParamsError(f"kv_transfer_params.decode is not a binding: {exc}") from exc
    if binding.transfer_id != tid:
        raise ParamsError("kv_transfer_params.decode belongs to another transfer_id")
    return SendParams(tid, binding, _trace(params), chosen)


def _trace(params: dict[str, Any]) -> TraceParent | None:
    value = params.get(TRACEPARENT)
    return parse_traceparent(value) if isinstance(value, str) else None


class PushReport(msgspec.Struct):
    """Whether P pushed: ``push`` is ``started`` or ``none`` (then with a ``reason``). A push
    that started and then failed tells D itself (a failed signal); ``none`` means D hears
    nothing, so the proxy lets D compute the prompt rather than wait for its load deadline."""

    push: str = ""
    reason: str = ""
    transfer_id: str | None = None

    @property
    def no_push_reason(self) -> str | None:
        return (self.reason or "no reason given") if self.push == "none" else None


def push_report(transfer_id: str | None, no_push_reason: str | None) -> dict[str, Any]:
    report: dict[str, Any] = {"transfer_id": transfer_id}
    if no_push_reason is None:
        report["push"] = "started"
    else:
        report["push"] = "none"
        report["reason"] = no_push_reason
    return report


_push_report = msgspec.json.Decoder(PushReport)


def parse_push_report(raw: bytes) -> PushReport | None:
    """P's ``kv_transfer_params`` as JSON bytes; ``None`` when absent or not an object of
    pdgate's (another connector's params): then assume the push happened."""
    if not raw or raw == b"null":
        return None
    try:
        return _push_report.decode(raw)
    except msgspec.DecodeError:
        return None
