"""Fixtures of the connector tests: a metaserver (the tiny model comes from tests/conftest.py)."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest

from tests.support.services import MetaserverProcess


@pytest.fixture
def metaserver(metaserver_factory: Callable[..., MetaserverProcess]) -> Iterator[MetaserverProcess]:
    yield metaserver_factory("memory", "--token", "t0ken")
