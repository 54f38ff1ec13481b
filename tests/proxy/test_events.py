"""``EventSink``: a mark whose binding is not written yet is posted again; others are not."""

from __future__ import annotations

from pdwire.client import ConflictError, MetaserverClientError, NotFoundError
from pdwire.models import BindingState, MarkDetail, MarkKind
from proxy.events import NOT_YET_S, EventSink


class ScriptedClient:
    """Answers each post with the next scripted error, then records it as stored."""

    def __init__(self, *errors: MetaserverClientError) -> None:
        self.errors = list(errors)
        self.calls = 0
        self.marks: list[tuple[str, MarkKind, MarkDetail | None]] = []

    async def post_mark(
        self, transfer_id: str, mark: MarkKind, actor: str, detail: MarkDetail | None = None
    ) -> None:
        self.calls += 1
        if self.errors:
            raise self.errors.pop(0)
        self.marks.append((transfer_id, mark, detail))


def _not_found() -> NotFoundError:
    return NotFoundError(404, "binding t not found", "POST", "/v1/bindings/t/events")


async def test_events_binding_written_late_gets_the_event() -> None:
    client, waits = ScriptedClient(_not_found(), _not_found()), list[float]()

    async def sleep(s: float) -> None:
        waits.append(s)

    sink = EventSink(client, sleep=sleep)
    sink.abandon("t", BindingState.FAILED, "P pushed nothing: no")
    await sink.drain()
    why = MarkDetail(outcome="failed", message="P pushed nothing: no")
    assert client.marks == [("t", MarkKind.ABANDONED, why)]
    assert waits == list(NOT_YET_S[:2]) and sink.sent == 1


async def test_events_binding_never_written_gives_up_after_the_waits() -> None:
    client, waits = ScriptedClient(*[_not_found() for _ in range(9)]), list[float]()

    async def sleep(s: float) -> None:
        waits.append(s)

    sink = EventSink(client, sleep=sleep)
    sink.abandon("t", BindingState.ABORTED)
    await sink.drain()
    assert client.calls == len(NOT_YET_S) + 1 and waits == list(NOT_YET_S)
    assert client.marks == [] and sink.sent == 0


async def test_events_other_errors_are_not_retried() -> None:
    conflict = ConflictError(409, "binding t is done", "POST", "/v1/bindings/t/events")
    client, waits = ScriptedClient(conflict), list[float]()

    async def sleep(s: float) -> None:
        waits.append(s)

    sink = EventSink(client, sleep=sleep)
    sink.abandon("t", BindingState.ABORTED)
    await sink.drain()
    assert client.calls == 1 and waits == [] and sink.sent == 0


async def test_events_mark_of_a_late_binding_is_posted_again() -> None:
    client, waits = ScriptedClient(_not_found()), list[float]()

    async def sleep(s: float) -> None:
        waits.append(s)

    sink = EventSink(client, sleep=sleep)
    sink.mark("t", MarkKind.END, 1.5, "ok")
    await sink.drain()
    assert client.marks == [("t", MarkKind.END, MarkDetail(since_request_s=1.5, outcome="ok"))]
    assert waits == [NOT_YET_S[0]] and sink.sent == 1


async def test_events_full_sink_drops_marks_and_counts_them() -> None:
    client = ScriptedClient()
    sink = EventSink(client, max_pending=1)
    sink.mark("t", MarkKind.FIRST_TOKEN, 0.1)
    sink.mark("t", MarkKind.END, 0.2)
    await sink.drain()
    assert [m for _, m, _ in client.marks] == [MarkKind.FIRST_TOKEN] and sink.dropped == 1
