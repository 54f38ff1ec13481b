"""Unique ids without per-call randomness: a random per-process prefix plus a counter.

Transfer ids match the contract's ``^[A-Za-z0-9._:-]{1,128}$``; each attempt gets a new one.
"""

from __future__ import annotations

import itertools
import os
import re

VALID_ID = re.compile(r"^[A-Za-z0-9._:-]{1,128}$")


class IdMaker:
    def __init__(self, kind: str) -> None:
        self._prefix = f"{kind}-{os.urandom(6).hex()}-"
        self._count = itertools.count(1)

    def next(self) -> str:
        return f"{self._prefix}{next(self._count)}"
