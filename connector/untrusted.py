"""Strings the other side of the side channel sent, as they go into a log line.

A P's ``sender``, ``error`` and engine id, a D's ``reason``: whoever reaches the side channel
(or holds its key) chooses them. In a log line they are quoted (``%r``: a newline is ``\\n``,
so no forged line of our own) and cut to ``LOG_CHARS``.
"""

from __future__ import annotations

LOG_CHARS = 200


def shown(text: str, limit: int = LOG_CHARS) -> str:
    """``text`` quoted, its first ``limit`` characters (``...`` after the quote: cut)."""
    return repr(text[:limit]) + ("..." if len(text) > limit else "")
