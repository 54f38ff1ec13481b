"""``BackgroundWriter`` sends the calls it finds ready together as one ``POST /v1/batch``, and
each call's outcome is the one it would have had alone: against a real metaserver, and against
scripted servers for an older metaserver and a call answered 503 inside a batch."""

from __future__ import annotations

import json
import threading
from collections.abc import Callable

import httpx

from pdwire.client import (
    BackgroundWriter,
    BindingWrite,
    MetaserverClient,
    ServerError,
    ValidationFailed,
)
from pdwire.models import Binding, BindingState
from tests.metaserver.conftest import binding_spec, decode_instance
from tests.metaserver.test_clients import FAST
from tests.support.fault_server import Reply, fault_server
from tests.support.services import MetaserverProcess

Outcomes = dict[str, tuple[bytes | None, Exception | None]]


def _recorder(outcomes: Outcomes, lock: threading.Lock, name: str) -> Callable[..., None]:
    def on_done(body: bytes | None, error: Exception | None) -> None:
        with lock:
            outcomes[name] = (body, error)

    return on_done


def _put_together(url: str, n: int) -> tuple[BackgroundWriter, Outcomes]:
    """Bindings ``t0`` … ``t{n-1}`` handed over at once to a one-lane writer (so they are
    ready together: one batch), the writer closed; its outcomes by transfer id."""
    writer = BackgroundWriter(MetaserverClient(url, retry=FAST), lanes=1)
    outcomes: Outcomes = {}
    lock = threading.Lock()
    writer.put_bindings(
        [
            BindingWrite(f"t{i}", binding_spec(), _recorder(outcomes, lock, f"t{i}"))
            for i in range(n)
        ]
    )
    writer.close(timeout_s=10)
    return writer, outcomes


def test_writer_batches_ready_writes_and_keeps_each_bindings_order(
    metaserver_factory: Callable[..., MetaserverProcess],
) -> None:
    ms = metaserver_factory()
    with MetaserverClient(ms.url, retry=FAST) as c:
        c.put_instance("decode-0", decode_instance())
    outcomes: Outcomes = {}
    lock = threading.Lock()
    writer = BackgroundWriter(MetaserverClient(ms.url, retry=FAST), lanes=2)
    n = 40
    writes = [
        BindingWrite(f"t{i}", binding_spec(), _recorder(outcomes, lock, f"put-t{i}"))
        for i in range(n)
    ]
    writes.append(  # refused on its own (no such decode instance); the others are not
        BindingWrite(
            "bad", binding_spec(decode_instance_id="ghost"), _recorder(outcomes, lock, "bad")
        )
    )
    assert writer.put_bindings(writes) == n + 1
    for i in range(n):  # each queued behind its own binding's PUT
        writer.post_event(
            f"t{i}",
            BindingState.PUSHING,
            "prefill-0",
            on_done=_recorder(outcomes, lock, f"ev-t{i}"),
        )
    writer.close(timeout_s=20)
    assert writer.pending() == 0 and writer.completed == 2 * n and writer.failed == 1
    assert writer.batching and 1 <= writer.batches < 2 * n  # fewer requests than calls
    for i in range(n):
        body, error = outcomes[f"put-t{i}"]
        assert error is None and body is not None
        assert Binding.model_validate_json(body).state is BindingState.BOUND
        body, error = outcomes[f"ev-t{i}"]
        assert error is None and body is not None
        assert Binding.model_validate_json(body).state is BindingState.PUSHING
    assert isinstance(outcomes["bad"][1], ValidationFailed)
    metrics = httpx.get(f"{ms.url}/metrics").text
    count = next(
        float(line.split()[-1])
        for line in metrics.splitlines()
        if line.startswith("pdgate_metaserver_batch_calls_count")
    )
    assert count == writer.batches
    with MetaserverClient(ms.url) as c:
        assert c.get_binding("t7").state is BindingState.PUSHING
        assert c.find_binding("bad") is None


def test_writer_goes_call_by_call_against_a_metaserver_without_batches() -> None:
    """An older metaserver answers ``POST /v1/batch`` 404: the writer sends each call alone,
    and no more batches after that."""
    with fault_server(Reply(404, b'{"detail":"Not Found"}'), default=Reply(201, b"{}")) as srv:
        writer, outcomes = _put_together(srv.url, 3)
        assert not writer.batching and writer.batches == 0
        assert all(outcomes[f"t{i}"] == (b"{}", None) for i in range(3))
        paths = [(method, path) for method, path, _ in srv.requests]
        assert paths[0] == ("POST", "/v1/batch")
        assert sorted(paths[1:]) == [("PUT", f"/v1/bindings/t{i}") for i in range(3)]


def test_writer_sends_a_call_answered_503_in_a_batch_again_alone() -> None:
    binding = json.loads(binding_spec().model_dump_json())
    answer = {
        "results": [
            {"status": 503, "body": {"detail": "redis unreachable"}},
            {"status": 201, "body": binding},
        ]
    }
    with fault_server(
        Reply(200, json.dumps(answer).encode()), default=Reply(201, b'{"again":1}')
    ) as srv:
        writer, outcomes = _put_together(srv.url, 2)
        assert outcomes["t0"] == (b'{"again":1}', None)  # its own PUT, after the batch
        assert outcomes["t1"][1] is None
        assert json.loads(outcomes["t1"][0] or b"") == binding
        assert [p for _, p, _ in srv.requests] == ["/v1/batch", "/v1/bindings/t0"]
        sent = json.loads(srv.requests[0][2])
        assert [c["path"] for c in sent["calls"]] == ["/v1/bindings/t0", "/v1/bindings/t1"]
        assert sent["calls"][0]["body"] == binding


def test_writer_reports_a_batch_failed_whole_to_each_call_without_sending_them_alone() -> None:
    """A 503 for the batch itself (after the client's retries): each call alone would fail the
    same way, so each gets that error and none is sent again."""
    with fault_server(default=Reply(503, b'{"detail":"overloaded"}')) as srv:
        writer, outcomes = _put_together(srv.url, 3)
        assert writer.failed == 3 and writer.batching
        assert all(isinstance(outcomes[f"t{i}"][1], ServerError) for i in range(3))
        assert {p for _, p, _ in srv.requests} == {"/v1/batch"}
        assert len(srv.requests) == FAST.retries + 1


def test_writer_sends_a_batch_refused_for_its_body_call_by_call() -> None:
    with fault_server(Reply(422, b'{"detail":[]}'), default=Reply(201, b"{}")) as srv:
        writer, outcomes = _put_together(srv.url, 2)
        assert all(outcomes[f"t{i}"] == (b"{}", None) for i in range(2))
        assert writer.batching  # still on: the next batch may well be taken
        assert [p for _, p, _ in srv.requests] == [
            "/v1/batch",
            "/v1/bindings/t0",
            "/v1/bindings/t1",
        ]
