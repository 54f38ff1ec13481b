"""The routing seam: a request's walk enters ``proxy.routing`` from the handler only — to open
the answer (``Dispatcher.open``: the selection, the attempt, the flow's walk) and to give D's
load back at the end; the flows never call back into it."""

from __future__ import annotations

import ast
import sys
from pathlib import Path
from types import FrameType

from proxy.config import Flow
from tests.proxy.inmemory import BINDING, PUSHED, InMemoryProxy
from tests.proxy.mock import MockBackend, Reply

ROOT = Path(__file__).resolve().parents[2]
ROUTING = str(ROOT / "proxy" / "routing")


async def test_a_decode_first_request_enters_routing_twice_from_the_handler() -> None:
    """Every call into ``proxy/routing`` from outside it while the request ran: (the caller's
    file, the callee). A coroutine the loop resumes is the same frame: counted once."""
    backend = MockBackend(
        {"prefill": PUSHED, "decode": Reply.completion("hi"), "get": Reply.json(BINDING)}
    )
    px = InMemoryProxy(backend, Flow.DECODE_FIRST)
    frames: list[FrameType] = []  # held, so that no id is reused while the request runs
    seen: list[tuple[str, str]] = []

    def profile(frame: FrameType, event: str, arg: object) -> None:
        if event != "call" or not frame.f_code.co_filename.startswith(ROUTING):
            return
        if any(f is frame for f in frames):
            return
        frames.append(frame)
        caller = frame.f_back
        where = "" if caller is None else caller.f_code.co_filename
        if not where.startswith(ROUTING):
            seen.append((str(Path(where).relative_to(ROOT)), frame.f_code.co_qualname))

    exchange = px.request()
    sys.setprofile(profile)
    try:
        reply = await exchange.done()
    finally:
        sys.setprofile(None)
    assert reply.status == 200
    assert sorted(c.leg for c in backend.calls) == ["decode", "get", "prefill"]
    assert seen == [
        ("proxy/handler.py", "Dispatcher.open"),
        ("proxy/handler.py", "Dispatcher.release"),
    ], seen
    await px.settle()


def test_the_flows_import_nothing_of_routing() -> None:
    for path in sorted((ROOT / "proxy" / "flows").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module]
            elif isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            for name in names:
                assert not name.startswith("proxy.routing"), (path.name, name)
