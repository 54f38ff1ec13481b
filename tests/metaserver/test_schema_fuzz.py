"""Property-based fuzzing of the whole OpenAPI surface (schemathesis, positive and negative
inputs): no input may produce a 5xx, and every status returned is one the schema documents."""

from __future__ import annotations

import hypothesis
import pytest
import schemathesis
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error, status_code_conformance
from schemathesis.core.result import Ok

from metaserver import MetaserverSettings, create_app
from metaserver.backend import memory_backend
from metaserver.store import MemoryStore
from pdwire.feed import FEED_PATH

pytestmark = pytest.mark.slow  # schemathesis over every route: not in `make test-fast`

APP = create_app(
    MetaserverSettings(max_wait_s=0.05),
    backend=memory_backend(MemoryStore(binding_ttl_s=60, retain_s=60)),
)
SCHEMA = schemathesis.openapi.from_asgi("/openapi.json", APP)
_RESULTS = list(SCHEMA.get_all_operations())
OPERATIONS = [result.ok() for result in _RESULTS if isinstance(result, Ok)]
assert len(OPERATIONS) == len(_RESULTS), "schemathesis cannot read every operation of the schema"
# /metrics is Prometheus text, not JSON; operations without inputs have no negative cases; the
# binding feed streams until the client leaves, so a valid query (negative cases add unknown
# parameters, which are valid too) never ends: tests/metaserver/test_feeds.py tests its 422s.
CASES = [
    pytest.param(op, mode, id=f"{op.method.upper()} {op.path} {mode.value}")
    for op in OPERATIONS
    if op.path not in ("/metrics", FEED_PATH)
    for mode in GenerationMode
    if mode is GenerationMode.POSITIVE or list(op.iter_parameters()) or list(op.body.items)
]


def test_schema_covers_every_route() -> None:
    paths = {(op.method.upper(), op.path) for op in OPERATIONS}
    assert ("PUT", "/v1/bindings/{transfer_id}") in paths
    assert ("POST", "/v1/bindings/{transfer_id}/events") in paths
    assert ("PUT", "/v1/instances/{instance_id}") in paths
    assert len(paths) >= 13


@pytest.mark.parametrize(("operation", "mode"), CASES)
def test_schema_no_server_errors(
    operation: schemathesis.APIOperation, mode: GenerationMode
) -> None:
    seen: list[int] = []

    @hypothesis.given(case=operation.as_strategy(mode))
    @hypothesis.settings(
        max_examples=25,
        deadline=None,
        derandomize=True,
        database=None,
        suppress_health_check=list(hypothesis.HealthCheck),
    )
    def run(case: schemathesis.Case) -> None:
        response = case.call()
        seen.append(response.status_code)
        case.validate_response(response, checks=[not_a_server_error, status_code_conformance])

    run()
    assert seen and all(code < 500 for code in seen)
