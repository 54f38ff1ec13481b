"""Transfer and instance ids: the one pattern, a check, and a cheap generator."""

from __future__ import annotations

import itertools
import os
import re

ID_BODY = r"[A-Za-z0-9._:-]{1,128}"  # the pattern without its anchors, to build paths' patterns
ID_PATTERN = rf"^{ID_BODY}$"  # transfer ids and instance ids alike
TRANSFER_ID_PATTERN = ID_PATTERN
INSTANCE_ID_PATTERN = ID_PATTERN
_ID = re.compile(ID_BODY)


def valid_id(value: object) -> bool:
    """The whole value is an id (``fullmatch``: ``re.match`` with ``$`` lets a trailing newline
    through, which then broke the Redis store's change messages)."""
    return isinstance(value, str) and _ID.fullmatch(value) is not None


class IdMaker:
    """Unique ids without per-call randomness: a random per-process prefix plus a counter
    (each attempt of a request gets a new transfer id)."""

    def __init__(self, kind: str) -> None:
        self.prefix = f"{kind}-{os.urandom(6).hex()}-"  # what every id of this maker starts with
        self._count = itertools.count(1)

    def next(self) -> str:
        return f"{self.prefix}{next(self._count)}"
