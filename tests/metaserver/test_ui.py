"""``/ui/``: the timeline page's files, served from the package, self-contained, and open
even where reads need the token (the page asks for it; the data calls check it)."""

from __future__ import annotations

import fnmatch
import re
import tomllib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx

from metaserver.ops import page as ui
from tests.metaserver.test_api import AUTH, TOKEN

ROOT = Path(__file__).resolve().parents[2]
UI = ROOT / "metaserver" / "ui"


async def test_ui_serves_the_page_and_its_assets(api: httpx.AsyncClient) -> None:
    r = await api.get("/ui/")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/html")
    assert 'src="timeline.js"' in r.text and 'href="timeline.css"' in r.text
    assert "connect-src 'self'" in r.headers["content-security-policy"]
    assert r.headers["x-content-type-options"] == "nosniff"
    js = await api.get("/ui/timeline.js")
    assert js.status_code == 200 and js.headers["content-type"].startswith("text/javascript")
    assert "../v1/bindings" in js.text  # relative: works under any path prefix
    panel = await api.get("/ui/breakdown.js")
    assert panel.status_code == 200 and panel.headers["content-type"].startswith("text/javascript")
    assert 'src="breakdown.js"' in r.text and "../v1/breakdown" in panel.text
    css = await api.get("/ui/timeline.css")
    assert css.status_code == 200 and css.headers["content-type"].startswith("text/css")
    r = await api.get("/ui", follow_redirects=False)
    assert r.status_code == 308 and r.headers["location"] == "ui/"
    for missing in ("/ui/nope.js", "/ui/..%2Fapp.py", "/ui/index.htm"):
        assert (await api.get(missing)).status_code == 404, missing
    assert (await api.get("/openapi.json")).json()["paths"].keys().isdisjoint({"/ui/", "/ui"})


async def test_ui_page_is_open_while_reads_need_the_token(
    api_factory: Callable[..., Any],
) -> None:
    api: httpx.AsyncClient = await api_factory(token=TOKEN, protect_reads=True)
    assert (await api.get("/ui/")).status_code == 200
    assert (await api.get("/ui/timeline.js")).status_code == 200
    assert (await api.get("/v1/bindings")).status_code == 401
    assert (await api.get("/v1/bindings", headers=AUTH)).status_code == 200


def test_ui_assets_need_nothing_from_elsewhere() -> None:
    for path in UI.iterdir():
        text = path.read_text()
        assert not re.search(r"(https?:)?//[a-z0-9.-]+\.[a-z]{2,}/", text, re.I), path.name
        assert "@import" not in text and "<iframe" not in text, path.name


def test_ui_every_asset_is_served_and_shipped_as_package_data() -> None:
    files = {p.name for p in UI.iterdir()}
    assert files == set(ui._TYPES)
    patterns = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"][
        "package-data"
    ]["metaserver"]
    for name in files:
        assert any(fnmatch.fnmatch(f"ui/{name}", p) for p in patterns), name
