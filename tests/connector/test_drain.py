"""The engines' preStop drain (``connector.drain``) against a real metaserver and an engine
``/metrics`` page served by ``prometheus_client`` (what vLLM serves it with)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import pytest
from prometheus_client import CollectorRegistry, Gauge, start_http_server

from connector.drain import busy_requests, drain, main
from pdwire.client import MetaserverClient
from pdwire.models import InstanceRole, InstanceSpec
from tests.support.procs import free_port
from tests.support.services import MetaserverProcess

TOKEN = "t0ken"


@dataclass
class EngineMetrics:
    """vLLM's scheduler gauges as its ``PrometheusStatLogger`` declares them
    (vllm/v1/metrics/loggers.py, ``PrometheusStatLogger.__init__``: ``vllm:num_requests_running``
    and ``vllm:num_requests_waiting``, labels ``model_name`` and ``engine``), two engines (data
    parallel), served over HTTP."""

    url: str
    running: Gauge
    waiting: Gauge

    def set(self, running: float, waiting: float = 0.0, engine: str = "0") -> None:
        self.running.labels("m", engine).set(running)
        self.waiting.labels("m", engine).set(waiting)


@pytest.fixture
def engine() -> Iterator[EngineMetrics]:
    reg = CollectorRegistry()
    running = Gauge("vllm:num_requests_running", "running", ["model_name", "engine"], registry=reg)
    waiting = Gauge("vllm:num_requests_waiting", "waiting", ["model_name", "engine"], registry=reg)
    Gauge("vllm:num_requests_waiting_by_reason", "by reason", ["reason"], registry=reg).labels(
        "capacity"
    ).set(7)  # not a request count of its own: must not be added
    port = free_port()
    server, thread = start_http_server(port, addr="127.0.0.1", registry=reg)
    metrics = EngineMetrics(f"http://127.0.0.1:{port}", running, waiting)
    for e in ("0", "1"):
        metrics.set(0, 0, e)
    try:
        yield metrics
    finally:
        server.shutdown()
        server.server_close()
        thread.join(5)


@pytest.fixture
def registry(metaserver_factory: Callable[..., MetaserverProcess]) -> Iterator[MetaserverClient]:
    ms = metaserver_factory("memory", "--token", TOKEN)
    with MetaserverClient(ms.url, token=TOKEN) as client:
        client.put_instance(
            "decode-7", InstanceSpec(role=InstanceRole.DECODE, url="http://10.0.0.7:8000")
        )
        yield client


def test_drain_busy_requests_sums_running_and_waiting_of_every_engine() -> None:
    text = (
        "# HELP vllm:num_requests_running x\n"
        'vllm:num_requests_running{engine="0",model_name="m"} 2.0\n'
        'vllm:num_requests_running{engine="1",model_name="m"} 1.0\n'
        'vllm:num_requests_waiting{engine="0",model_name="m"} 3.0\n'
        'vllm:num_requests_waiting_by_reason{reason="capacity"} 9.0\n'
        "vllm:num_requests_waiting 1\n"
    )
    assert busy_requests(text) == 7.0


def test_drain_marks_the_registration_then_waits_for_the_engine_to_be_idle(
    engine: EngineMetrics, registry: MetaserverClient
) -> None:
    engine.set(running=1, waiting=1, engine="1")
    threading.Timer(0.6, engine.set, kwargs={"running": 0, "waiting": 1, "engine": "1"}).start()
    threading.Timer(1.0, engine.set, kwargs={"running": 0, "waiting": 0, "engine": "1"}).start()
    report = drain(registry, "decode-7", engine.url, settle_s=0.2, timeout_s=20, poll_s=0.1)
    assert report.marked and report.idle
    assert 1.0 <= report.waited_s < 5
    assert registry.get_instance("decode-7").draining is True


def test_drain_waits_at_least_the_settle_time_and_gives_up_at_the_timeout(
    engine: EngineMetrics, registry: MetaserverClient
) -> None:
    started = time.monotonic()
    report = drain(registry, "decode-7", engine.url, settle_s=0.8, timeout_s=5, poll_s=0.1)
    assert report.idle and report.waited_s >= 0.8 and time.monotonic() - started >= 0.8
    engine.set(running=3)
    report = drain(registry, "decode-7", engine.url, settle_s=0.1, timeout_s=0.6, poll_s=0.1)
    assert report.marked and not report.idle and 0.6 <= report.waited_s < 3


def test_drain_of_an_unregistered_instance_or_a_dead_engine_still_ends(
    registry: MetaserverClient,
) -> None:
    dead = f"http://127.0.0.1:{free_port()}"
    report = drain(registry, "ghost", dead, settle_s=0.1, timeout_s=5, poll_s=0.05)
    assert not report.marked and report.idle  # an engine that is gone has nothing in flight
    assert registry.get_instance("decode-7").draining is False


def test_drain_cli_refuses_a_metaserver_url_it_cannot_use(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["--metaserver", "metaserver:8300", "--instance-id", "decode-0"])
    assert exc.value.code == 2
    assert "--metaserver" in capsys.readouterr().err
