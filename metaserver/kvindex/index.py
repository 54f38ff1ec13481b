"""``KVIndex``: ``instance → block keys`` with longest-prefix matching, and its in-memory form.

Keys are ``pdwire.kv_events.block_key`` values (64 bits). Each instance's entries are bounded
(``max_blocks``, well above any engine's block count): stores past it are dropped and counted,
which can only make matches shorter, never wrong.

Beside what the engines' events say, a proxy *places* a prompt's keys on the instances it just
sent it to (``place``): they count as held there for ``placed_s`` (``PLACED_S`` by default,
``--kv-placed``: about the time a long prompt takes until the engine has computed it and its
events say so). So every proxy replica sees
where the others sent a prompt a moment ago; a replica's own memory of it
(``proxy.policies.kv``) was its alone.
"""

from __future__ import annotations

import abc
import enum
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass

DEFAULT_MAX_BLOCKS = 1_000_000
PLACED_S = 10.0
MAX_PLACED = 200_000  # placed keys per instance (memory; the oldest go first)


class Op(enum.Enum):
    STORE = "store"
    REMOVE = "remove"
    CLEAR = "clear"


@dataclass(frozen=True, slots=True)
class Change:
    op: Op
    keys: Sequence[int] = ()


@dataclass(frozen=True, slots=True)
class Placement:
    """A prompt's block keys a proxy just sent to ``instance``."""

    instance: str
    keys: Sequence[int]


class KVIndex(abc.ABC):
    description: str

    @abc.abstractmethod
    async def apply(self, instance_id: str, changes: Sequence[Change]) -> None:
        """Apply one batch of an instance's events, in order."""

    @abc.abstractmethod
    async def drop(self, instance_id: str) -> None:
        """Forget the instance (it left, restarted, or its stream lost events)."""

    @abc.abstractmethod
    async def place(self, placements: Sequence[Placement]) -> None:
        """Count each placement's keys as held by its instance for ``placed_s`` (a proxy just
        sent them there), all in one write; an instance's ``CLEAR`` or ``drop`` forgets them."""

    @abc.abstractmethod
    async def match(
        self, keys: Sequence[int], instance_ids: Iterable[str], placed: bool = True
    ) -> dict[str, int]:
        """Per instance: how many of ``keys``, from the first, it holds (or, with ``placed``,
        was placed)."""

    @abc.abstractmethod
    async def sizes(self) -> dict[str, int]:
        """Entries per indexed instance."""

    async def lead(self, me: str, ttl_s: float) -> bool:
        """Whether ``me`` follows the engines (one metaserver does; a lease of ``ttl_s``)."""
        return True

    async def touch(self, instance_id: str) -> None:  # noqa: B027 - nothing expires in memory
        """Keep the instance's entries (a shared index expires what nobody follows)."""

    @property
    @abc.abstractmethod
    def dropped(self) -> int:
        """Stores dropped because an instance was at ``max_blocks`` (this process)."""


class MemoryKVIndex(KVIndex):
    description = "memory"

    def __init__(
        self,
        max_blocks: int = DEFAULT_MAX_BLOCKS,
        clock: Callable[[], float] = time.monotonic,
        *,
        placed_s: float = PLACED_S,
    ) -> None:
        self._placed_s = placed_s
        self._blocks: dict[str, set[int]] = {}
        self._placed: dict[str, OrderedDict[int, float]] = {}  # key: until, oldest first
        self._max = max_blocks
        self._dropped = 0
        self._clock = clock

    async def apply(self, instance_id: str, changes: Sequence[Change]) -> None:
        held = self._blocks.setdefault(instance_id, set())
        for change in changes:
            if change.op is Op.STORE:
                room = self._max - len(held)
                keys = change.keys
                if len(keys) > room:
                    self._dropped += len(keys) - max(room, 0)
                    keys = keys[: max(room, 0)]
                held.update(keys)
            elif change.op is Op.REMOVE:
                held.difference_update(change.keys)
            else:
                held.clear()
                self._placed.pop(instance_id, None)  # placed before the engine cleared it

    async def drop(self, instance_id: str) -> None:
        self._blocks.pop(instance_id, None)
        self._placed.pop(instance_id, None)

    async def place(self, placements: Sequence[Placement]) -> None:
        now = self._clock()
        until = now + self._placed_s
        for p in placements:
            placed = self._placed.setdefault(p.instance, OrderedDict())
            for k in p.keys:
                placed[k] = until
                placed.move_to_end(k)
            while placed and (len(placed) > MAX_PLACED or next(iter(placed.values())) < now):
                placed.popitem(last=False)

    async def match(
        self, keys: Sequence[int], instance_ids: Iterable[str], placed: bool = True
    ) -> dict[str, int]:
        out: dict[str, int] = {}
        now = self._clock()
        for iid in instance_ids:
            held = self._blocks.get(iid) or set()
            there: Mapping[int, float] = (self._placed.get(iid) if placed else None) or {}
            n = 0
            for k in keys:
                if k not in held:
                    until = there.get(k)
                    if until is None or until < now:
                        break
                n += 1
            out[iid] = n
        return out

    async def sizes(self) -> dict[str, int]:
        return {iid: len(held) for iid, held in self._blocks.items()}

    @property
    def dropped(self) -> int:
        return self._dropped
