"""Run ``metaserver.access.Access.resolve`` for listed tokens without an event loop."""

from __future__ import annotations

from metaserver.access import Access, Principal


def resolved(access: Access, header: str | bytes, *, write: bool = True) -> Principal:
    """``access.resolve`` for a token the credentials list (it never waits: no Kubernetes
    review), run to its end without an event loop."""
    coro = access.resolve(header, write=write)
    try:
        coro.send(None)
    except StopIteration as done:
        who: Principal = done.value
        return who
    coro.close()
    raise AssertionError("resolve waited: not a listed token")
