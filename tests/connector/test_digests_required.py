"""A transfer that started with digests is checked whole: a done signal without digests does
not skip the check (review 2: a digest-less ``Signal`` skipped ``verify_kv``), and a D with
``verify_kv`` checks every load, so it fails one whose P did not sign its pieces."""

from __future__ import annotations

import pytest

from connector import wire
from connector.worker.receiver import RecvTracker
from tests.connector import cluster as C

DIGEST: wire.Digest = (0, 4096, 64, 7)


class Clock:
    now = 100.0

    def __call__(self) -> float:
        return self.now


def _tracker(require: bool = False) -> RecvTracker:
    t = RecvTracker(30.0, Clock())
    t.verify = lambda sig: ""  # every digest matches what landed
    t.require_digests = require
    return t


def _signal(
    sender: str, digests: list[wire.Digest], signed: bool, expected: int = 1
) -> wire.Signal:
    return wire.Signal("t1", sender, True, expected, digests=digests, signed=signed)


def test_a_signal_without_digests_fails_a_transfer_whose_others_carry_them() -> None:
    t = _tracker()
    t.expect("r1", "t1")
    t.on_signal(_signal("p/0", [DIGEST], True, expected=2))
    t.on_signal(_signal("evil/1", [], False, expected=2))  # forged, or a rank that skipped
    assert t.poll() == ({"r1"}, {"r1"})
    assert t.unverified == 1 and t.verified == 0


def test_a_d_that_checks_every_load_fails_an_unsigned_one() -> None:
    t = _tracker(require=True)
    t.expect("r1", "t1")
    t.on_signal(_signal("p/0", [], False))
    assert t.poll() == ({"r1"}, {"r1"})
    assert t.unverified == 1


def test_a_signed_transfer_with_nothing_to_check_is_intact() -> None:
    t = _tracker(require=True)
    t.expect("r1", "t1")
    t.on_signal(_signal("p/0", [], True))  # P signs, but wrote no piece
    assert t.poll() == ({"r1"}, set())


def test_a_d_with_verify_kv_fails_the_load_of_a_p_without(monkeypatch: pytest.MonkeyPatch) -> None:
    port = C.free_port_range(1)
    monkeypatch.setenv("PDGATE_CONNECTOR_VERIFY_KV", "1")
    d = C.make_instance("d-eng", "kv_consumer", 1, port=port)
    monkeypatch.delenv("PDGATE_CONNECTOR_VERIFY_KV")
    p = C.make_instance("p-eng", "kv_producer", 1)  # in-process writes land: P signs nothing
    try:
        C.fill_prefill(p)
        C.expect(d, "dreq", "tv", [1, 2])
        C.push(p, "preq", "tv", C.destination(d, port), [[(0, 1), (1, 2)]])
        got = C.poll(d, set(), lambda acc: "dreq" in acc[0][1])
        assert got[0][2] == {"dreq"} and d.workers[0].tracker.unverified == 1
    finally:
        C.close(p, d)
