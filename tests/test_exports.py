"""Each package's public surface is pinned (like httpx's ``test_exported_members``), and the
layering the contract package exists for holds: proxy, connector and metaserver import pdwire
and never each other; pdwire imports none of them, nor FastAPI, vLLM, torch or Mooncake."""

from __future__ import annotations

import ast
import importlib
import subprocess
import sys
import types
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

EXPORTS: dict[str, list[str]] = {
    "pdwire": [
        "ID_PATTERN",
        "PROTOCOL_VERSION",
        "Binding",
        "BindingSpec",
        "BindingState",
        "EventDetail",
        "EventIn",
        "IdMaker",
        "Instance",
        "InstanceRole",
        "InstanceSpec",
        "KVEndpoint",
        "Mark",
        "MarkDetail",
        "MarkIn",
        "MarkKind",
        "ParamsError",
        "PushReport",
        "RecvParams",
        "SendParams",
        "WireError",
        "decode_leg",
        "mismatch",
        "parse_decode_leg",
        "parse_prefill_leg",
        "parse_push_report",
        "prefill_leg",
        "pull_prefill_leg",
        "push_report",
        "valid_id",
    ],
    "pdwire.client": [
        "NO_BACKOFF",
        "AsyncMetaserverClient",
        "AuthError",
        "Backoff",
        "BackgroundWriter",
        "BadRequest",
        "BindingWrite",
        "ConflictError",
        "MetaserverClient",
        "MetaserverClientError",
        "MetaserverHTTPError",
        "MetaserverUnavailable",
        "NotFoundError",
        "PayloadTooLargeError",
        "RetryPolicy",
        "ServerError",
        "ValidationFailed",
        "auth_headers",
        "binding_url",
    ],
    "proxy": ["ProxySettings", "create_app"],
    "metaserver": ["MemoryStore", "MetaserverSettings", "Store", "create_app", "create_store"],
    "launch": ["LaunchPlan", "Supervisor", "build_plan"],
    "connector": ["PdgateConnector"],
}

# the three parts and what each may not import
PARTS = ("proxy", "connector", "metaserver")
HEAVY = ("fastapi", "starlette", "uvicorn", "vllm", "torch", "mooncake")


def _public(module: types.ModuleType) -> set[str]:
    """Names a user reaches as ``module.X``: everything but private names and submodules."""
    return {
        name
        for name, value in vars(module).items()
        if not name.startswith("_")
        and not isinstance(value, types.ModuleType)
        and name != "annotations"
    }


@pytest.mark.parametrize("package", sorted(set(EXPORTS) - {"connector"}))
def test_exported_members_are_pinned(package: str) -> None:
    module = importlib.import_module(package)
    exported = list(module.__all__)
    assert sorted(exported) == sorted(EXPORTS[package]), package
    assert _public(module) == set(exported), "a public name outside __all__ (or the reverse)"
    for name in exported:
        assert getattr(module, name) is not None


def test_exported_members_connector_stays_light() -> None:
    """vLLM imports ``connector`` in its API process: the package exports its one class lazily
    (importing it checks the vLLM version first), so the package itself loads no vLLM."""
    code = (
        "import sys, connector; "
        f"print(sorted(connector.__all__), [m for m in {HEAVY!r} if m in sys.modules])"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True
    )
    assert out.stdout.split("] [")[0] + "]" == str(EXPORTS["connector"])
    assert out.stdout.strip().endswith("[]"), out.stdout
    connector = importlib.import_module("connector")
    assert connector.PdgateConnector.__name__ == "PdgateConnector"


def _imports(package: str) -> dict[str, set[str]]:
    """Top-level package of every module each file of ``package`` imports (``import x.y`` and
    ``from x.y import z``, including imports inside functions)."""
    found: dict[str, set[str]] = {}
    for path in sorted((ROOT / package).rglob("*.py")):
        tree = ast.parse(path.read_text(), filename=str(path))
        tops: set[str] = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                tops.update(alias.name.split(".")[0] for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                tops.add(node.module.split(".")[0])
        found[str(path.relative_to(ROOT))] = tops
    return found


@pytest.mark.parametrize("part", PARTS)
def test_parts_import_the_contract_and_not_each_other(part: str) -> None:
    others = set(PARTS) - {part}
    crossing = {f: sorted(t & others) for f, t in _imports(part).items() if t & others}
    assert not crossing, crossing
    assert any("pdwire" in t for t in _imports(part).values())


def test_pdwire_imports_no_part_and_nothing_heavy() -> None:
    banned = set(PARTS) | set(HEAVY) | {"launch"}
    crossing = {f: sorted(t & banned) for f, t in _imports("pdwire").items() if t & banned}
    assert not crossing, crossing
    code = (
        "import sys, pdwire, pdwire.client, pdservice.settings, pdservice.asgi, pdservice.limits; "
        f"print([m for m in {(*HEAVY, *PARTS)!r} if m in sys.modules])"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True
    )
    assert out.stdout.strip() == "[]", out.stdout


def test_pdservice_imports_no_part_nor_the_contract() -> None:
    """What the processes share beyond the contract stands below every part and pdwire."""
    banned = set(PARTS) | {"launch", "pdwire"}
    crossing = {f: sorted(t & banned) for f, t in _imports("pdservice").items() if t & banned}
    assert not crossing, crossing


def test_launch_imports_no_part() -> None:
    """pd-launch plans and starts the parts; it reads their files through pdwire and
    pdservice, never through a part's internals."""
    crossing = {f: sorted(t & set(PARTS)) for f, t in _imports("launch").items() if t & set(PARTS)}
    assert not crossing, crossing
