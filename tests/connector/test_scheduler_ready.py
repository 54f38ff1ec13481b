"""D's wait from "the KV is all there" to the request's first step (``kv_ready_wait_seconds``)."""

from __future__ import annotations

from connector.metadata import PdgateWorkerMetadata
from connector.scheduler.ready import KEY, ReadyWait
from connector.stats import StatsCollector


class Wall:
    def __init__(self) -> None:
        self.now = 5000.0

    def __call__(self) -> float:
        return self.now


def test_ready_wait_times_each_load_from_ready_to_its_first_step() -> None:
    stats, wall = StatsCollector(), Wall()
    w = ReadyWait(stats, wall)
    assert not w
    w.ready({"r1": 4999.998, "r2": 4999.990})
    assert w
    wall.now += 0.001
    w.scheduled(["other", "r1"])  # a request that never waited for KV is not timed
    (data,) = [stats.take()]
    assert data is not None and [round(x, 6) for x in data[KEY]] == [0.003]
    w.scheduled(["r1"])  # timed once only
    assert stats.take() is None
    w.forget("r2")  # aborted before it was scheduled
    w.scheduled(["r2"])
    assert stats.take() is None and not w


def test_ready_wait_never_observes_a_negative_wait_and_stays_bounded() -> None:
    stats, wall = StatsCollector(), Wall()
    w = ReadyWait(stats, wall, max_pending=2)
    w.ready({"r1": wall.now + 0.002})  # another host's clock, slightly ahead
    w.scheduled(["r1"])
    data = stats.take()
    assert data is not None and data[KEY] == [0.0]
    w.ready({"a": 1.0, "b": 2.0, "c": 3.0})  # never scheduled nor finished: the oldest goes
    w.scheduled(["a", "b", "c"])
    data = stats.take()
    assert data is not None and len(data[KEY]) == 2


def test_worker_metadata_ranks_combine_to_the_latest_ready_time() -> None:
    a = PdgateWorkerMetadata(frozenset({"s1"}), {"r1": 10.0, "r2": 12.0})
    b = PdgateWorkerMetadata(frozenset(), {"r1": 11.0})
    both = a.aggregate(b)
    assert isinstance(both, PdgateWorkerMetadata)
    assert both.silent == {"s1"} and both.ready == {"r1": 11.0, "r2": 12.0}
    assert a.ready == {"r1": 10.0, "r2": 12.0}  # the operands are left alone
