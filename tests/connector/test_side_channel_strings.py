"""What a peer says on the side channel is bounded, and D logs what P says quoted and cut.

A ``Signal``'s ``expected``, ``sender`` and ``error`` and a ``Hello``'s ``p_engine_id`` had no
bound, and D logged P's strings as they came: a newline in one forged a log line of D's own
(review 2, N14). Now ``expected`` is at most P's TP limit, the strings have lengths, transfer
ids their pattern, and every string from the other side is logged as ``%r`` of its first
``LOG_CHARS`` characters."""

from __future__ import annotations

import logging
from typing import Any

import msgspec
import pytest

from connector import wire
from connector.worker.keepalive import KeepAlive
from connector.worker.receiver import RecvTracker
from pdwire.models import MAX_TP_SIZE

FORGED = "no room\n2026-11-28 12:00:00 INFO pdgate.connector.receiver: all is well"


def _decode(**fields: Any) -> wire.Message:
    raw = {"type": "signal", "transfer_id": "t-1", "sender": "p/0", "ok": True, "expected": 1}
    return wire.decode(msgspec.msgpack.encode(raw | fields))


def test_signal_fields_are_bounded_at_decode() -> None:
    assert isinstance(_decode(expected=MAX_TP_SIZE), wire.Signal)
    for bad in (
        {"expected": MAX_TP_SIZE + 1},
        {"expected": 0},
        {"error": "e" * (wire.MAX_ERROR_CHARS + 1)},
        {"sender": "p" * (wire.MAX_NAME_CHARS + 1)},
        {"transfer_id": "t\n1"},
        {"transfer_id": "t-1\n"},
        {"instance": "p-0\n"},
        {"transfer_id": "t" * 129},
    ):
        with pytest.raises(msgspec.ValidationError):
            _decode(**bad)


def test_hello_alive_and_refused_are_bounded_at_decode() -> None:
    for raw in (
        {"type": "hello", "p_engine_id": "p" * (wire.MAX_NAME_CHARS + 1)},
        {"type": "alive", "sender": "p/0", "transfer_ids": ["t"] * (wire.MAX_ALIVE_IDS + 1)},
        {"type": "alive", "sender": "p/0", "transfer_ids": ["t\n"]},
        {"type": "refused", "reason": "r" * (wire.MAX_ERROR_CHARS + 1)},
    ):
        with pytest.raises(msgspec.ValidationError):
            wire.decode(msgspec.msgpack.encode(raw))


def test_d_logs_what_p_says_quoted_and_cut(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG, logger="pdgate")
    tracker = RecvTracker(30.0)
    tracker.expect("req", "t-1")
    tracker.on_signal(wire.Signal("t-1", "p\n/0", False, 1, FORGED + "x" * 5000))
    assert tracker.poll() == ({"req"}, {"req"})
    said = [r.getMessage() for r in caplog.records if r.name.startswith("pdgate")]
    assert said and not [m for m in said if "\n" in m]
    assert all(len(m) < 1500 for m in said)
    assert any(repr(FORGED)[:60] in m for m in said)


def test_p_cuts_its_error_to_what_d_reads() -> None:
    """A failed push's reason (an exception's text) may be long: P sends its start."""
    from connector.worker.record import signal_error

    assert signal_error("x" * 10_000) == "x" * wire.MAX_ERROR_CHARS
    assert signal_error("short") == "short"


class _Dest:
    host, engine_id = "127.0.0.1", "d"


class _Open:
    def __init__(self, tid: str) -> None:
        self.transfer_id, self.dest, self.d_port = tid, _Dest(), 5600


class _Ledger:
    on_open = None

    def __init__(self, n: int) -> None:
        self.open = [_Open(f"t-{i}") for i in range(n)]

    def open_transfers(self) -> list[_Open]:
        return self.open


class _Client:
    def __init__(self) -> None:
        self.sent: list[wire.Alive] = []

    def send(self, host: str, port: int, msg: wire.Alive) -> bool:
        self.sent.append(msg)
        return True


def test_p_names_many_open_transfers_in_several_keep_alives() -> None:
    client = _Client()
    keepalive = KeepAlive("p/0", _Ledger(wire.MAX_ALIVE_IDS + 5), 0.5)  # type: ignore[arg-type]
    keepalive.beat(client)  # type: ignore[arg-type]
    assert [len(a.transfer_ids) for a in client.sent] == [wire.MAX_ALIVE_IDS, 5]
    for alive in client.sent:
        wire.decode(wire.encode(alive))  # each one D reads
