"""Each package's public surface is pinned (like httpx's ``test_exported_members``), and the
layering the contract package exists for holds: proxy, connector and metaserver import pdwire
and never each other; pdwire imports none of them, nor FastAPI, vLLM, torch or Mooncake. Inside
a package, modules import each other without a circle."""

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


# packages whose modules import each other without a circle (connector: connector.worker.traces
# and connector.worker.transfer still import each other, one of them under TYPE_CHECKING)
ACYCLIC = ("proxy", "connector", "metaserver", "pdwire", "pdservice", "launch")


def _module_graph(package: str, root: Path = ROOT) -> dict[str, set[str]]:
    """Module -> the modules of ``package`` it imports: every ``import`` and ``from`` statement,
    at any depth (inside functions, under ``TYPE_CHECKING``), relative ones resolved; ``from p
    import m`` names module ``m`` when ``p.m`` is one. Importing a submodule also runs its
    parent package's ``__init__``: that implicit edge is not counted."""
    files = {
        ".".join(path.relative_to(root).with_suffix("").parts).removesuffix(".__init__"): path
        for path in sorted((root / package).rglob("*.py"))
    }

    def owner(name: str) -> str | None:
        while name and name not in files:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, set[str]] = {}
    for module, path in files.items():
        here = module if path.name == "__init__.py" else module.rpartition(".")[0]
        targets: list[str] = []
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.Import):
                targets += [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = here.rsplit(".", node.level - 1)[0] if node.level > 1 else here
                    base = f"{up}.{base}" if base else up
                for alias in node.names:
                    full = f"{base}.{alias.name}"
                    targets.append(full if full in files else base)
        graph[module] = {t for t in map(owner, targets) if t is not None and t != module}
    return graph


def _circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


@pytest.mark.parametrize("package", ACYCLIC)
def test_modules_import_each_other_without_a_circle(package: str) -> None:
    assert _circles(_module_graph(package)) == []


def test_the_circle_check_sees_imports_in_functions_and_relative_ones(tmp_path: Path) -> None:
    (tmp_path / "p" / "sub").mkdir(parents=True)
    files = {
        "p/__init__.py": "from p.a import A\n",  # the package's __init__: no circle with a
        "p/a.py": "from p.sub import b\nA = 1\n",
        "p/sub/__init__.py": "",
        "p/sub/b.py": "def f():\n    from ..c import C  # deferred\n",
        "p/c.py": "import typing\nif typing.TYPE_CHECKING:\n    from p import a\nC = 1\n",
        "p/d.py": "from . import c\n",
    }
    for name, text in files.items():
        (tmp_path / name).write_text(text)
    graph = _module_graph("p", tmp_path)
    assert graph["p.sub.b"] == {"p.c"} and graph["p.d"] == {"p.c"}
    assert _circles(graph) == [["p.a", "p.c", "p.sub.b"]]
