"""P taking a binding: while the metaserver does not answer (fault injection: the client fails
the way ``pdwire.client`` does when every attempt timed out), and when its answer names another
holder of the lease."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any, cast

import pytest

from connector.scheduler import lookups as L
from pdwire.client import AsyncMetaserverClient, ConflictError, MetaserverUnavailable
from pdwire.models import Binding, BindingState, Event


def record(tid: str, holder: str) -> Binding:
    """The binding as the metaserver answers a ``prefill_started`` it took: ``holder``'s."""
    events = [Event(state=BindingState.BOUND, actor="dec-1", at=1.0),
              Event(state=BindingState.PREFILL_STARTED, actor=holder, at=2.0)]  # fmt: skip
    return Binding(
        request_id="r", decode_instance_id="dec-1", engine_id="e",
        kv_endpoint={"host": "127.0.0.1", "port": 5600}, block_size=16, block_ids=[[1]],
        num_prompt_tokens=16, transfer_id=tid, state=BindingState.PREFILL_STARTED,
        created_at=1.0, updated_at=2.0, events=events,
    )  # fmt: skip


class FlakyMetaserver:
    """``post_event`` fails ``failures`` times as unreachable, then gives ``then`` (None: the
    record, with the lease ``holder``'s: the caller's unless told otherwise)."""

    def __init__(
        self, failures: int, then: Exception | None = None, holder: str | None = None
    ) -> None:
        self.failures = failures
        self.then = then
        self.holder = holder
        self.calls: list[tuple[str, BindingState, str]] = []

    async def post_event(self, tid: str, state: BindingState, actor: str, **_: Any) -> Binding:
        self.calls.append((tid, state, actor))
        if len(self.calls) <= self.failures:
            raise MetaserverUnavailable(f"POST .../{tid}/events failed after 4 attempts")
        if self.then is not None:
            raise self.then
        return record(tid, self.holder or actor)

    async def close(self) -> None:
        pass


@pytest.fixture(autouse=True)
def fast_pause(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(L, "CLAIM_PAUSE_S", 0.05)


def lookups_on(server: FlakyMetaserver) -> Iterator[L.Lookups]:
    lk = L.Lookups(
        lambda: cast(AsyncMetaserverClient, server), binding_wait_s=1.0, instance_ttl_s=1.0
    )
    try:
        yield lk
    finally:
        lk.close()


def settle(lk: L.Lookups, tid: str, until: float, limit_s: float = 10.0) -> L.Claim:
    """Ask as the scheduler does, once per step, until the claim is decided."""
    end = time.monotonic() + limit_s
    while time.monotonic() < end:
        got = lk.claim(tid, "prefill-0", until)
        if got is not None:
            return got
        time.sleep(0.01)
    raise AssertionError(f"claim of {tid} undecided after {limit_s}s")


def test_claim_outlasts_a_metaserver_that_does_not_answer_for_a_while() -> None:
    server = FlakyMetaserver(failures=3)
    for lk in lookups_on(server):
        claim = settle(lk, "tid-1", until=time.time() + 30)
        assert claim == L.Claim(True, record=record("tid-1", "prefill-0"))
    assert len(server.calls) == 4
    assert {c for c in server.calls} == {("tid-1", BindingState.PREFILL_STARTED, "prefill-0")}


def test_claim_gives_up_at_the_deadline() -> None:
    server = FlakyMetaserver(failures=10_000)
    for lk in lookups_on(server):
        began = time.monotonic()
        claim = settle(lk, "tid-2", until=time.time() + 0.5)
        took = time.monotonic() - began
    assert not claim.won
    assert claim.why.startswith("could not take the binding: ")
    assert 2 <= len(server.calls)
    assert took < 5.0


def test_claim_without_a_deadline_is_tried_once() -> None:
    server = FlakyMetaserver(failures=1)
    for lk in lookups_on(server):
        claim = settle(lk, "tid-3", until=0.0)
    assert not claim.won
    assert len(server.calls) == 1


def test_claim_retried_into_an_ended_binding_is_lost() -> None:
    # D gave up while the metaserver was away: the late claim must not win
    server = FlakyMetaserver(failures=2, then=ConflictError(409, "binding is failed"))
    for lk in lookups_on(server):
        claim = settle(lk, "tid-4", until=time.time() + 30)
    assert not claim.won
    assert "ended before P took it" in claim.why
    assert len(server.calls) == 3


def test_a_claim_answered_with_another_holder_is_lost() -> None:
    """A metaserver that answers a second ``prefill_started`` with 200 and the record (as one
    before the exclusive lease did): the lease is another P's, so this P pushes nothing."""
    server = FlakyMetaserver(failures=0, holder="prefill-other")
    for lk in lookups_on(server):
        claim = settle(lk, "tid-5", until=time.time() + 30)
    assert not claim.won and claim.record is None
    assert "('prefill-other') holds the lease" in claim.why
