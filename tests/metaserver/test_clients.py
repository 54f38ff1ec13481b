"""The async (aiohttp) and blocking clients, and the fire-and-forget BackgroundWriter."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

import pytest

from pdwire.client import (
    AsyncMetaserverClient,
    AuthError,
    BackgroundWriter,
    Backoff,
    ConflictError,
    MetaserverClient,
    MetaserverUnavailable,
    NotFoundError,
    RetryPolicy,
    ServerError,
    ValidationFailed,
)
from pdwire.models import BindingState, EventDetail
from tests.metaserver.conftest import binding_spec, decode_instance
from tests.support.fault_server import Reply, fault_server
from tests.support.procs import free_port
from tests.support.services import MetaserverProcess, RedisServer

FAST = RetryPolicy(retries=2, backoff=Backoff(base=0.01, cap=0.02))


async def test_async_client_full_cycle_against_real_server(
    metaserver_factory: Callable[..., MetaserverProcess],
) -> None:
    ms = metaserver_factory("memory", "--token", "tok")
    async with AsyncMetaserverClient(ms.url, token="tok", retry=FAST) as c:
        inst = await c.put_instance("decode-0", decode_instance())
        assert inst.instance_id == "decode-0"
        assert [i.instance_id for i in await c.list_instances("decode")] == ["decode-0"]
        b = await c.put_binding("t1", binding_spec())
        assert b.state is BindingState.BOUND
        with pytest.raises(ConflictError) as err:
            await c.put_binding("t1", binding_spec(num_cached_tokens=0))
        assert err.value.status == 409
        done = await c.post_event("t1", BindingState.DONE, "p0", EventDetail(bytes_pushed=10))
        assert done.events[-1].detail == EventDetail(bytes_pushed=10)
        waited = await c.get_binding("t1", wait=5, state=BindingState.DONE)
        assert waited.state is BindingState.DONE
        assert [x.transfer_id for x in await c.list_bindings(state=BindingState.DONE)] == ["t1"]
        assert (await c.stats()).bindings_by_state["done"] == 1
        assert await c.find_binding("missing") is None
        with pytest.raises(NotFoundError):
            await c.get_binding("missing", wait=0.2)
        with pytest.raises(ValidationFailed):
            await c.put_binding("t2", binding_spec(decode_instance_id="ghost"))
        await c.delete_binding("t1")
        assert await c.ready() is True
    async with AsyncMetaserverClient(ms.url, token="wrong", retry=FAST) as bad:
        with pytest.raises(AuthError):
            await bad.put_instance("x", decode_instance())


async def test_clients_drain_and_undrain_against_a_redis_metaserver(
    redis_server: RedisServer, metaserver_factory: Callable[..., MetaserverProcess]
) -> None:
    ms = metaserver_factory(redis_server.url, "--token", "tok", "--namespace", "drain-clients")
    async with AsyncMetaserverClient(ms.url, token="tok", retry=FAST) as c:
        await c.put_instance("decode-0", decode_instance())
        assert (await c.set_draining("decode-0")).draining is True
        assert (await c.put_instance("decode-0", decode_instance())).draining is True
        assert [i.draining for i in await c.list_instances()] == [True]
        with pytest.raises(NotFoundError):
            await c.set_draining("ghost")
    with MetaserverClient(ms.url, token="tok", retry=FAST) as sync:
        assert sync.get_instance("decode-0").draining is True
        assert sync.set_draining("decode-0", False).draining is False
        assert sync.get_instance("decode-0").draining is False
        with pytest.raises(NotFoundError):
            sync.set_draining("ghost", False)
    with MetaserverClient(ms.url, token="wrong", retry=FAST) as bad:
        with pytest.raises(AuthError):
            bad.set_draining("decode-0")


async def test_async_client_retries_5xx_then_succeeds() -> None:
    with fault_server(
        Reply(503, b'{"detail":"redis down"}'),
        Reply(502),
        default=Reply(200, b'{"status":"ready"}'),
    ) as srv:
        async with AsyncMetaserverClient(srv.url, retry=FAST) as c:
            assert await c.ready() is True
        assert len(srv.requests) == 3


async def test_async_client_gives_up_after_retries_with_typed_error() -> None:
    with fault_server(default=Reply(503, b'{"detail":"redis down"}')) as srv:
        async with AsyncMetaserverClient(srv.url, retry=FAST) as c:
            with pytest.raises(ServerError) as err:
                await c.get_binding("t1")
        assert err.value.status == 503 and err.value.detail == "redis down"
        assert len(srv.requests) == 3  # 1 + 2 retries


async def test_async_client_never_retries_4xx() -> None:
    with fault_server(default=Reply(404, b'{"detail":"nope"}')) as srv:
        async with AsyncMetaserverClient(srv.url, retry=FAST) as c:
            with pytest.raises(NotFoundError):
                await c.get_binding("t1")
        assert len(srv.requests) == 1


async def test_async_client_connection_refused_and_timeout() -> None:
    port = free_port()
    async with AsyncMetaserverClient(f"http://127.0.0.1:{port}", retry=FAST) as c:
        with pytest.raises(MetaserverUnavailable, match="after 3 attempts"):
            await c.get_binding("t1")
    # the server never answers (until the test ends): only the client's own timeout returns.
    # It is a socket timeout, on real time: the bound leaves 0.7 s over it for a loopback call
    with fault_server(default=Reply(200, b"{}", hold=threading.Event())) as srv:
        async with AsyncMetaserverClient(srv.url, timeout_s=0.2, retry=RetryPolicy(retries=0)) as c:
            started = time.monotonic()
            with pytest.raises(MetaserverUnavailable):
                await c.get_binding("t1")
            assert time.monotonic() - started < 0.9


def test_sync_client_retries_resets_and_maps_errors() -> None:
    with fault_server(
        Reply(reset=True), Reply(500), default=Reply(409, b'{"detail":"differs"}')
    ) as srv:
        with MetaserverClient(srv.url, retry=FAST) as c:
            with pytest.raises(ConflictError, match="differs"):
                c.put_binding("t1", binding_spec())
        assert len(srv.requests) == 3
    with MetaserverClient(f"http://127.0.0.1:{free_port()}", retry=FAST) as c:
        with pytest.raises(MetaserverUnavailable):
            c.delete_binding("t1")


def test_sync_client_reconnects_once_when_a_kept_alive_connection_was_closed() -> None:
    # the server ends an idle keep-alive connection (uvicorn does after 5 s): the next call
    # goes out again on a new connection at once, without spending a retry
    with fault_server(Reply(200, b"{}", close_after=True), Reply(204, b"")) as srv:
        with MetaserverClient(srv.url, retry=RetryPolicy(retries=0)) as c:
            c.delete_binding("t1")
            c.delete_binding("t2")
        assert [path for _, path, _ in srv.requests] == ["/v1/bindings/t1", "/v1/bindings/t2"]


def test_sync_client_times_out_a_silent_server() -> None:
    # as in the async client's test: a server that never answers; a socket timeout, real time
    with fault_server(default=Reply(200, b"{}", hold=threading.Event())) as srv:
        with MetaserverClient(srv.url, timeout_s=0.2, retry=RetryPolicy(retries=0)) as c:
            started = time.monotonic()
            with pytest.raises(MetaserverUnavailable):
                c.get_binding("t1")
            assert time.monotonic() - started < 0.9


def test_sync_client_refuses_a_url_it_cannot_use() -> None:
    with pytest.raises(ValueError, match="http"):
        MetaserverClient("metaserver:8300")


def test_sync_client_against_real_server(
    metaserver_factory: Callable[..., MetaserverProcess],
) -> None:
    ms = metaserver_factory()
    with MetaserverClient(ms.url, retry=FAST) as c:
        c.put_instance("decode-0", decode_instance())
        assert c.put_binding("t1", binding_spec()).state is BindingState.BOUND
        assert c.post_event("t1", BindingState.PUSHING, "p").state is BindingState.PUSHING
        assert c.get_binding("t1").transfer_id == "t1"
        assert c.find_binding("none") is None


def test_background_writer_never_blocks_and_reports_outcomes() -> None:
    """The submits return while the metaserver has answered nothing (it answers when the test
    lets it): a submit that waited for an answer would never return."""
    answer = threading.Event()
    with fault_server(default=Reply(201, b"{}", hold=answer)) as srv:
        client = MetaserverClient(srv.url, retry=FAST, timeout_s=60)  # held, not timed out
        writer = BackgroundWriter(client, maxsize=2, batch_max=1)
        outcomes: list[tuple[bytes | None, Exception | None]] = []
        accepted: list[bool] = []
        took: list[float] = []

        def on_done(body: bytes | None, error: Exception | None) -> None:
            outcomes.append((body, error))

        def submit() -> None:
            started = time.perf_counter()
            accepted.extend(writer.put_binding(f"t{i}", binding_spec(), on_done) for i in range(6))
            took.append(time.perf_counter() - started)

        submitter = threading.Thread(target=submit, daemon=True)
        submitter.start()
        submitter.join(30)  # right: microseconds; wrong: for ever (nothing is answered)
        assert took, "a submit waited for the metaserver's answer"
        assert outcomes == []  # and none was answered meanwhile
        # six queue puts take microseconds: a second is a margin for a loaded machine, not a wait
        assert took[0] < 1.0, f"submit blocked for {took[0]:.3f}s"
        # one in flight + 2 queued are accepted, the rest are dropped (and counted)
        assert accepted.count(True) in (2, 3) and writer.dropped == accepted.count(False)
        answer.set()
        writer.close(timeout_s=5)
        assert all(err is None and body == b"{}" for body, err in outcomes)
        assert len(outcomes) == accepted.count(True)


def test_background_writer_slow_write_delays_only_its_own_binding() -> None:
    """One write that hangs (the server answers it only when the test lets it) does not hold
    the bindings of other requests; the calls about the slow binding itself still go in
    submission order."""
    answer = threading.Event()
    with fault_server(Reply(201, b"{}", hold=answer), default=Reply(201, b"{}")) as srv:
        # one call per request (this server answers every call alike): batches are tested
        # against the real metaserver below
        client = MetaserverClient(srv.url, retry=FAST, timeout_s=60)  # held, not timed out
        writer = BackgroundWriter(client, batch_max=1)
        finished: list[str] = []
        lock = threading.Lock()
        others_done, all_done = threading.Event(), threading.Event()

        def record(name: str) -> Callable[[bytes | None, Exception | None], None]:
            def on_done(_body: bytes | None, error: Exception | None) -> None:
                assert error is None
                with lock:
                    finished.append(name)
                    if {f"t{i}" for i in range(5)} <= set(finished):
                        others_done.set()
                    if len(finished) == 7:
                        all_done.set()

            return on_done

        writer.put_binding("slow", binding_spec(), record("slow"))
        while not srv.requests:  # the slow PUT is on the wire
            time.sleep(0.005)
        writer.post_event("slow", BindingState.ABORTED, "d", on_done=record("slow-event"))
        for i in range(5):
            writer.put_binding(f"t{i}", binding_spec(), record(f"t{i}"))
        # right: the others land at once; wrong: behind a write that is never answered
        assert others_done.wait(30), finished
        with lock:
            assert sorted(finished) == [f"t{i}" for i in range(5)]  # not behind the slow write
        answer.set()
        assert all_done.wait(30)
        writer.close()
    assert finished[5:] == ["slow", "slow-event"]  # the event waited for its PUT
    paths = [path for _, path, _ in srv.requests]
    assert paths.index("/v1/bindings/slow/events") > paths.index("/v1/bindings/t4")


def test_background_writer_close_finishes_what_was_submitted() -> None:
    with fault_server(default=Reply(201, b"{}", delay_s=0.05)) as srv:
        writer = BackgroundWriter(MetaserverClient(srv.url, retry=FAST), lanes=2, batch_max=1)
        for i in range(4):
            writer.put_binding(f"t{i}", binding_spec())
            writer.post_event(f"t{i}", BindingState.DONE, "p")
        writer.close(timeout_s=10)
        assert writer.completed == 8 and writer.pending() == 0
        assert len(srv.requests) == 8
    with MetaserverClient("http://127.0.0.1:9") as c, pytest.raises(ValueError, match="lanes"):
        BackgroundWriter(c, lanes=0)


def test_background_writer_reports_failures_to_callback() -> None:
    with fault_server(default=Reply(422, b'{"detail":"not registered"}')) as srv:
        writer = BackgroundWriter(MetaserverClient(srv.url, retry=FAST))
        got: list[Exception | None] = []
        event = threading.Event()

        def done(_body: bytes | None, error: Exception | None) -> None:
            got.append(error)
            event.set()

        writer.post_event("t1", BindingState.DONE, "p", on_done=done)
        assert event.wait(5)
        assert isinstance(got[0], ValidationFailed)
        assert writer.failed == 1
        writer.close()


@pytest.mark.parametrize("quiet", [True, False])
def test_background_writer_late_event_conflict_is_quiet_only_when_asked(
    quiet: bool, caplog: pytest.LogCaptureFixture
) -> None:
    """P's scheduler posts ``prefill_started`` while P's worker (another process) may already
    have posted ``pushing``: that 409 is expected and must not read as a failure in the log."""
    caplog.set_level(logging.DEBUG, logger="pdgate")
    body = b'{"detail":"binding t1 is pushing; cannot become prefill_started"}'
    with fault_server(default=Reply(409, body)) as srv:
        writer = BackgroundWriter(MetaserverClient(srv.url, retry=FAST))
        got: list[Exception | None] = []
        event = threading.Event()

        def done(_body: bytes | None, error: Exception | None) -> None:
            got.append(error)
            event.set()

        writer.post_event(
            "t1", BindingState.PREFILL_STARTED, "p", on_done=done, quiet_conflict=quiet
        )
        assert event.wait(5)
        writer.close()
    assert isinstance(got[0], ConflictError)  # the caller still learns of it
    levels = {r.levelno for r in caplog.records if "cannot become" in r.getMessage()}
    assert levels == ({logging.DEBUG} if quiet else {logging.WARNING})
