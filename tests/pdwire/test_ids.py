"""Transfer and instance ids (pdwire/ids.py)."""

from __future__ import annotations

import pytest

from pdwire.ids import IdMaker, valid_id


@pytest.mark.parametrize("value", ["x", "pd-0a1b-7", "decode-0", "a.b:c_d-9", "x" * 128])
def test_ids_valid(value: str) -> None:
    assert valid_id(value)


@pytest.mark.parametrize(
    "value", ["", "x\n", "x\r\n", "\nx", "x y", "x/y", "é", "x" * 129, None, 7, b"x"]
)
def test_ids_invalid_whole_value_only(value: object) -> None:
    """A trailing newline is not an id (``re.match`` with ``$`` accepted ``"x\\n"``)."""
    assert not valid_id(value)


def test_ids_made_are_valid_unique_and_unguessable() -> None:
    make = IdMaker("pd")
    ids = [make.next() for _ in range(100)]
    assert all(valid_id(i) for i in ids) and len(set(ids)) == 100
    assert all(i.startswith(make.prefix) for i in ids)  # the binding feed's subscription
    # 128 random bits after the prefix, not a counter one above the id a client saw
    suffixes = [i.removeprefix(make.prefix) for i in ids]
    assert all(len(s) == 32 and int(s, 16) >= 0 for s in suffixes)
    assert sorted(suffixes) != suffixes
