"""``pdwire.trace`` and the ``traceparent`` the leg params carry."""

from __future__ import annotations

import pytest

from pdwire.params import decode_leg, parse_decode_leg, parse_prefill_leg, prefill_leg
from pdwire.trace import TraceParent, format_traceparent, parse_traceparent

GOOD = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"


def test_trace_parse_and_format_round_trip() -> None:
    tp = parse_traceparent(GOOD)
    assert tp == TraceParent(0x4BF92F3577B34DA6A3CE929D0E0E4736, 0x00F067AA0BA902B7, 1)
    assert tp.sampled and tp.header() == GOOD
    assert parse_traceparent(GOOD.encode()) == tp
    assert format_traceparent(1, 2, 0) == "00-" + "0" * 31 + "1-" + "0" * 15 + "2-00"


def test_trace_future_version_is_read_by_its_first_fields() -> None:
    tp = parse_traceparent("cc" + GOOD[2:] + "-what-comes-next")
    assert tp is not None and tp.span_id == 0x00F067AA0BA902B7


@pytest.mark.parametrize(
    "value",
    [
        None,
        "",
        GOOD[:-1],
        GOOD + "-extra",  # version 00 has exactly four fields
        "ff" + GOOD[2:],  # version ff is invalid
        GOOD.upper(),  # lowercase hex only
        "00-" + "0" * 32 + GOOD[35:],  # all-zero trace id
        GOOD[:36] + "0" * 16 + "-01",  # all-zero span id
        GOOD.replace("-", "_"),
        "00-4bf92f3577b34da6a3ce929d0e0e473g-00f067aa0ba902b7-01",
    ],
)
def test_trace_malformed_is_none(value: str | None) -> None:
    assert parse_traceparent(value) is None


def test_trace_leg_params_carry_a_valid_traceparent_and_drop_a_bad_one() -> None:
    d = decode_leg("pd-1", "http://ms", GOOD)
    assert d["traceparent"] == GOOD
    recv = parse_decode_leg(d)
    assert recv is not None and recv.trace == parse_traceparent(GOOD)
    p = prefill_leg("pd-1", "http://ms", None, GOOD)
    send = parse_prefill_leg(p)
    assert send is not None and send.trace is not None and send.trace.header() == GOOD
    assert "traceparent" not in decode_leg("pd-1", "http://ms")
    bad = parse_decode_leg({**d, "traceparent": "garbage"})
    assert bad is not None and bad.trace is None  # never an error: the request goes on
    bad_p = parse_prefill_leg({**p, "traceparent": 7})
    assert bad_p is not None and bad_p.trace is None
