"""A metaserver client's bearer token: a fixed string, or a file re-read when it changes.

Kubernetes rotates a projected ServiceAccount token in place (the kubelet swaps a symlink, long
before the old one expires): a client holding the file's first contents would fail once it
expires. ``FileToken`` looks at the file (one ``stat``) at most every ``check_s`` and reads it
again when it changed; between looks each use costs a clock read. A file that cannot be read
at start raises ``ValueError``; later, the last token read stays in use (and the failure is
logged once).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from typing import NamedTuple

log = logging.getLogger("pdgate.pdwire.client")

TokenSource = Callable[[], str | None]
Token = str | TokenSource | None  # what a client's ``token`` may be
CHECK_S = 1.0


def token_of(token: Token) -> str | None:
    """The token to send now."""
    return token() if callable(token) else token


class _Stamp(NamedTuple):
    inode: int
    mtime_ns: int
    size: int


class FileToken:
    def __init__(
        self, path: str, *, check_s: float = CHECK_S, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.path = path
        self._check = check_s
        self._clock = clock
        self._lock = threading.Lock()
        try:
            stamp, token = self._read()
        except OSError as exc:
            raise ValueError(f"token file {path}: {exc.strerror or exc}") from None
        if not token:
            raise ValueError(f"token file {path} is empty")
        self._stamp, self._token = stamp, token
        self._next = clock() + check_s
        self._failing = False

    def _read(self) -> tuple[_Stamp, str]:
        with open(self.path, "rb") as f:
            st = os.fstat(f.fileno())
            text = f.read().decode("utf-8", "replace").strip()
        return _Stamp(st.st_ino, st.st_mtime_ns, st.st_size), text

    def __call__(self) -> str:
        now = self._clock()
        if now < self._next:
            return self._token
        with self._lock:
            if now >= self._next:
                self._next = now + self._check
                self._refresh()
            return self._token

    def _refresh(self) -> None:
        """Under the lock: read the file again if it is not the one read last."""
        try:
            st = os.stat(self.path)
            if _Stamp(st.st_ino, st.st_mtime_ns, st.st_size) == self._stamp:
                return
            stamp, token = self._read()
        except OSError as exc:
            if not self._failing:
                log.warning("token file %s: %s; keeping the last token", self.path, exc)
            self._failing = True
            return
        self._failing = False
        if token:  # caught mid-write (empty): the next look reads it again
            self._stamp, self._token = stamp, token
            log.info("token file %s changed: using its new token", self.path)

    def __repr__(self) -> str:  # never the token itself
        return f"FileToken({self.path!r})"
