"""Fixtures of the connector tests: a metaserver (the tiny model comes from tests/conftest.py)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.support.services import InThreadMetaserver


@pytest.fixture
def metaserver() -> Iterator[InThreadMetaserver]:
    """A fresh metaserver (memory store, token ``t0ken``) per test, served from a thread."""
    ms = InThreadMetaserver(token="t0ken")
    try:
        yield ms
    finally:
        ms.stop()
