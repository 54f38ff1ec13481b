"""docs/protocol.md against the contract: every field the code sends is on the page, and
every field on the page is in the code."""

from __future__ import annotations

import re
from pathlib import Path

import msgspec
import pytest

from connector import wire
from pdwire import version
from pdwire.models import (
    Binding,
    BindingSpec,
    EventDetail,
    InstanceSpec,
    Mark,
    MarkDetail,
    MarkIn,
    MarkKind,
)
from pdwire.params import decode_leg, prefill_leg, pull_prefill_leg, push_report

DOC = (Path(__file__).resolve().parents[2] / "docs" / "protocol.md").read_text()


def _section(title: str) -> str:
    start = DOC.index(f"## {title}")
    end = DOC.find("\n## ", start + 1)
    return DOC[start : end if end != -1 else None]


def _ticked(text: str) -> set[str]:
    return set(re.findall(r"`([a-z_]+)`", text))


def test_protocol_doc_states_the_protocol_version() -> None:
    m = re.search(r"`pdwire\.version\.PROTOCOL_VERSION` is \*\*(\d+)\*\*", DOC)
    assert m is not None and int(m.group(1)) == version.PROTOCOL_VERSION


def test_protocol_doc_binding_table_is_binding_spec() -> None:
    section = _section("Binding (metaserver record)")
    rows = set(re.findall(r"^\| `(\w+)` \|", section, re.M))
    assert rows == set(BindingSpec.model_fields)
    added = set(Binding.model_fields) - set(BindingSpec.model_fields)
    assert added <= _ticked(section), added - _ticked(section)
    assert set(EventDetail.model_fields) <= _ticked(section)


def test_protocol_doc_names_every_mark_kind_and_field() -> None:
    section = _section("Binding marks")
    rows = set(re.findall(r"^\| `(\w+)` \|", section, re.M))
    assert rows == {k.value for k in MarkKind}
    named = set(MarkIn.model_fields) | set(Mark.model_fields) | set(MarkDetail.model_fields)
    assert named <= _ticked(section), named - _ticked(section)


def test_protocol_doc_instance_registration_is_instance_spec() -> None:
    section = _section("Instance registration")
    m = re.search(r"`\{([^}]*)\}`", section)
    assert m is not None
    named = {part.split(":")[0].strip().rstrip("?") for part in m.group(1).split(",")}
    assert named == set(InstanceSpec.model_fields)


@pytest.mark.parametrize(
    "params",
    [
        decode_leg("T", "URL", "TP"),
        prefill_leg("T", "URL", {}, "TP"),
        push_report("T", None),
        push_report("T", "why"),
    ],
    ids=["decode-leg", "prefill-leg", "push-started", "push-none"],
)
def test_protocol_doc_names_every_kv_transfer_params_key(params: dict[str, object]) -> None:
    flow = _section("Decode-first flow (layerwise push; the default)")
    missing = {k for k in params if f'"{k}"' not in flow and f"`{k}`" not in flow}
    assert not missing, missing


def test_protocol_doc_prefill_first_params_are_pull_prefill_leg() -> None:
    flow = _section("Prefill-first flow (pull connectors: vLLM's NixlConnector)")
    m = re.search(r"`kv_transfer_params = (\{[^`]*\})`", flow)
    assert m is not None
    assert msgspec.json.decode(m.group(1).replace("\n", " ")) == pull_prefill_leg()


@pytest.mark.parametrize("message", [wire.Hello, wire.Welcome, wire.Refused, wire.Signal])
def test_protocol_doc_side_channel_table_is_wire(message: type[msgspec.Struct]) -> None:
    section = _section("P–D side channel (ZeroMQ, msgpack; `connector/wire.py`)")
    row = re.search(rf"^\| `{message.__name__}` \|[^|]*\|(.*)\|$", section, re.M)
    assert row is not None, message.__name__
    fields = {f.name for f in msgspec.structs.fields(message)}
    documented = set(re.findall(r"(?:^|, )`([a-z_]+)`", row.group(1).strip()))
    assert documented == fields, documented ^ fields
