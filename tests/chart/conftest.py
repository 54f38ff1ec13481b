"""Fixtures of the chart tests: the chart, loaded once, and one render per value set."""

from __future__ import annotations

import helm_python as helm
import pytest

from tests.chart.rendering import SCENARIOS, Rendered, load_chart, render


@pytest.fixture(scope="session")
def chart() -> helm.Chart:
    return load_chart()


@pytest.fixture(scope="session")
def renders(chart: helm.Chart) -> dict[str, Rendered]:
    return {name: render(values, chart=chart) for name, values in SCENARIOS.items()}


@pytest.fixture(params=sorted(SCENARIOS))
def scenario(request: pytest.FixtureRequest, renders: dict[str, Rendered]) -> tuple[str, Rendered]:
    name: str = request.param
    return name, renders[name]
