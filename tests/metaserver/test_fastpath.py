"""The ASGI fast path answers exactly like the documented FastAPI routes it short-cuts."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest
from fastapi import FastAPI

from metaserver import MetaserverSettings, create_app
from metaserver.backend import memory_backend
from metaserver.bindings.fastpath import FastPath
from metaserver.store import MemoryStore
from tests.metaserver.test_api import instance_json, spec_json

TOKEN = {"authorization": "Bearer t"}
SCRIPT: list[tuple[str, str, dict[str, Any] | bytes | None, dict[str, str]]] = [
    ("PUT", "/v1/instances/decode-0", instance_json(), TOKEN),
    ("PUT", "/v1/bindings/t1", spec_json(), TOKEN),
    ("PUT", "/v1/bindings/t1", spec_json(), TOKEN),
    ("PUT", "/v1/bindings/t1", spec_json(num_cached_tokens=0), TOKEN),
    ("PUT", "/v1/bindings/t2", spec_json(), {}),
    ("PUT", "/v1/bindings/t2", spec_json(decode_instance_id="ghost"), TOKEN),
    ("PUT", "/v1/bindings/t2", b"{not json", TOKEN),
    ("PUT", "/v1/bindings/t2", {"block_size": 0}, TOKEN),
    ("PUT", "/v1/bindings/t2", {"x": "y" * 5000}, TOKEN),
    ("GET", "/v1/bindings/t1", None, TOKEN),
    ("GET", "/v1/bindings/none", None, TOKEN),
    ("GET", "/v1/bindings/none?wait=0.05", None, TOKEN),
    ("GET", "/v1/bindings/t1?wait=0.05&state=done", None, TOKEN),
    ("GET", "/v1/bindings/t1?state=bound&wait=0.05", None, TOKEN),
    ("GET", "/v1/bindings/t1?wait=-1", None, TOKEN),
    ("GET", "/v1/bindings/t1?wait=0.05&state=sideways", None, TOKEN),
    ("POST", "/v1/bindings/t1/events", {"state": "pushing", "actor": "p"}, TOKEN),
    ("POST", "/v1/bindings/t1/events", {"state": "bogus", "actor": "p"}, TOKEN),
    ("POST", "/v1/bindings/t1/events", {"state": "done", "actor": "p"}, {}),
    ("POST", "/v1/bindings/t1/events", {"state": "done", "actor": "p"}, TOKEN),
    ("POST", "/v1/bindings/t1/events", {"state": "pushing", "actor": "p"}, TOKEN),
    ("POST", "/v1/bindings/nope/events", {"state": "done", "actor": "p"}, TOKEN),
    ("GET", "/v1/bindings/t1", None, TOKEN),
    ("GET", "/v1/bindings/t1", None, {}),  # reads need the token too
    ("GET", "/v1/bindings/t1?wait=0.05", None, {}),
]


def without_fast_path(app: FastAPI) -> None:
    app.middleware_stack = FastAPI.build_middleware_stack(app)


def comparable(r: httpx.Response) -> tuple[int, Any, str | None]:
    try:
        body: Any = r.json()
    except ValueError:
        body = r.text
    return r.status_code, body, r.headers.get("x-pdgate-wait")


async def run_script(app: FastAPI) -> list[tuple[int, Any, str | None]]:
    out = []
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url="http://ms") as c:
        for method, path, body, headers in SCRIPT:
            kwargs: dict[str, Any] = {"headers": headers}
            if isinstance(body, bytes):
                kwargs["content"] = body
            elif body is not None:
                kwargs["json"] = body
            out.append(comparable(await c.request(method, path, **kwargs)))
    return out


@pytest.fixture
async def apps() -> AsyncIterator[tuple[FastAPI, FastAPI]]:
    settings = MetaserverSettings(token="t", max_body_bytes=4096)
    fast = create_app(
        settings,
        backend=memory_backend(MemoryStore(binding_ttl_s=60, retain_s=60)),
        clock=lambda: 1e9,
    )
    slow = create_app(
        settings,
        backend=memory_backend(MemoryStore(binding_ttl_s=60, retain_s=60)),
        clock=lambda: 1e9,
    )
    without_fast_path(slow)
    yield fast, slow


async def test_fastpath_matches_documented_routes(apps: tuple[FastAPI, FastAPI]) -> None:
    fast, slow = apps
    got, expected = await run_script(fast), await run_script(slow)
    statuses = [s for s, _, _ in expected]
    assert statuses == [201, 201, 200, 409, 401, 422, 422, 422, 413, 200, 404, 404, 200, 200,
                        422, 422, 200, 422, 401, 200, 409, 404, 200, 401, 401]  # fmt: skip
    for step, (a, b) in enumerate(zip(got, expected, strict=True)):
        assert a == b, f"step {step} {SCRIPT[step][:2]}: fast path {a} != routes {b}"
    assert expected[12][2] == "timeout"


def test_fastpath_takes_the_hot_calls_and_leaves_the_rest() -> None:
    app = create_app(
        MetaserverSettings(), backend=memory_backend(MemoryStore(binding_ttl_s=60, retain_s=60))
    )
    fp = FastPath(app, app.state.ctx)

    def match(method: str, path: str, query: bytes = b"") -> bool:
        scope = {"type": "http", "method": method, "path": path, "query_string": query}
        return fp._match(scope) is not None

    assert match("PUT", "/v1/bindings/t1")
    assert match("GET", "/v1/bindings/t1")
    assert match("GET", "/v1/bindings/t1", b"wait=2.5")
    assert match("GET", "/v1/bindings/t1", b"wait=2&state=done")
    assert match("POST", "/v1/bindings/t1/events")
    assert match("POST", "/v1/batch")
    assert not match("GET", "/v1/batch")
    assert not match("GET", "/v1/bindings")
    assert not match("DELETE", "/v1/bindings/t1")
    assert not match("GET", "/v1/bindings/t1", b"wait=nan")
    assert not match("GET", "/v1/bindings/t1", b"wait=1&extra=2")
    assert not match("PUT", "/v1/bindings/bad id")
    assert not match("GET", "/v1/instances/x")
