"""``/ui/``: the transfers timeline page (static HTML, JS and CSS shipped in the package, under
``metaserver/ui/``).

The page holds no data: it reads ``GET /v1/bindings``, ``GET /v1/instances`` and
``GET /v1/breakdown`` from the browser, so those calls keep their own authorization
(reads are protected unless ``--open-reads``: the page asks for a token and sends it as a
bearer header). The files
are read once, when the app is built, and served with a content security policy that allows
this origin only — the page loads nothing from elsewhere and works with no internet.
"""

from __future__ import annotations

from importlib import resources

from fastapi import APIRouter, Response
from fastapi.responses import RedirectResponse

from metaserver.errors import NotFound

_TYPES = {
    "index.html": "text/html; charset=utf-8",
    "timeline.js": "text/javascript; charset=utf-8",
    "timeline.css": "text/css; charset=utf-8",
    "breakdown.js": "text/javascript; charset=utf-8",
}
_HEADERS = {
    "cache-control": "no-cache",
    "x-content-type-options": "nosniff",
    "content-security-policy": (
        "default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; "
        "img-src 'self' data:; base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
    ),
}


def _load() -> dict[str, bytes]:
    folder = resources.files("metaserver") / "ui"
    return {name: (folder / name).read_bytes() for name in _TYPES}


def make_router() -> APIRouter:
    assets = _load()
    router = APIRouter(tags=["ui"], include_in_schema=False)

    def asset(name: str) -> Response:
        body = assets.get(name)
        if body is None:
            raise NotFound(f"no page asset {name!r}")
        return Response(body, 200, _HEADERS, _TYPES[name])

    @router.get("/ui")
    async def ui_root() -> Response:
        return RedirectResponse("ui/", 308)

    @router.get("/ui/")
    async def ui_index() -> Response:
        return asset("index.html")

    @router.get("/ui/{name}")
    async def ui_asset(name: str) -> Response:
        return asset(name)

    return router
