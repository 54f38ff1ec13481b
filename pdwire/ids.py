"""Transfer and instance ids: the one pattern, a check, and a cheap generator."""

from __future__ import annotations

import os
import re

ID_BODY = r"[A-Za-z0-9._:-]{1,128}"  # the pattern without its anchors, to build paths' patterns
ID_PATTERN = rf"^{ID_BODY}$"  # transfer ids and instance ids alike
TRANSFER_ID_PATTERN = ID_PATTERN
INSTANCE_ID_PATTERN = ID_PATTERN
_ID = re.compile(ID_BODY)
RANDOM_BYTES = 16  # per id


def valid_id(value: object) -> bool:
    """The whole value is an id (``fullmatch``: ``re.match`` with ``$`` lets a trailing newline
    through, which then broke the Redis store's change messages)."""
    return isinstance(value, str) and _ID.fullmatch(value) is not None


class IdMaker:
    """Ids nobody can guess: a random per-process prefix (what the proxy's binding feed asks
    for) and 128 random bits per id (each attempt of a request gets a new transfer id). A
    counter made the next transfer id one more than the one a client saw in its answer, and
    anyone who could reach a D's side channel could then name a transfer before its P did."""

    def __init__(self, kind: str) -> None:
        self.prefix = f"{kind}-{os.urandom(6).hex()}-"  # what every id of this maker starts with

    def next(self) -> str:
        return f"{self.prefix}{os.urandom(RANDOM_BYTES).hex()}"
