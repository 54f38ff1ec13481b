"""What D holds per transfer from P's ranks: done signals, keep-alives, digests ahead of a signal.

``RecvTracker`` (receiver.py) keeps one ``Arrivals`` per transfer id in its ``Inbox``, made by
the first message about the transfer, whether or not a request expects it yet. Signals are
counted per sender: one per P rank writing into this D rank at most (``MAX_SENDERS``).

One that no request expects is *early* (buffered for up to the deadline): P is rarely ahead of
D's own scheduler by more than a step, so at most ``MAX_EARLY`` transfers are held so, the
oldest dropped first (a flood from whoever reaches the side channel), in arrival order, which
is also their expiry order: ``expire`` drops the expired ones from the front and never looks at
the rest. Early entries hold ``MAX_EARLY_DIGESTS`` digests at most, all together.

Digests that did not fit in a signal arrive ahead of it (``Digests``); ``whole`` joins them to
their sender's signal and notes a sender whose digests did not all arrive as unverifiable.

Runs under the tracker's lock, on the side-channel thread (messages in) and on vLLM's forward
thread (``RecvTracker.expect`` and ``poll``).
"""

from __future__ import annotations

import collections
import logging
from dataclasses import dataclass, field

import msgspec

from connector import wire
from pdwire.fields import MAX_TP_SIZE

log = logging.getLogger("pdgate.connector.receiver")

# Transfers D holds signals or keep-alives for before it expects them: P is rarely ahead of
# D's own scheduler by more than a step, so a few thousand is a flood, not a backlog
MAX_EARLY = 4096
# Done signals one transfer may have: one per P rank writing into this D rank at most
MAX_SENDERS = MAX_TP_SIZE
# Digests held for early entries, all together (about 180 bytes each in Python: ~190 MB)
MAX_EARLY_DIGESTS = 1 << 20


@dataclass
class Arrivals:
    """One transfer's messages from P, by sender (a P rank)."""

    first_at: float
    by_sender: dict[str, wire.Signal] = field(default_factory=dict)
    settle_until: float = 0.0  # a P rank's failed write may land until then: hold the blocks
    alive_at: float | None = None  # P's last keep-alive for this transfer
    last_wall: float = 0.0  # wall clock of the latest done signal (``RecvTracker.take_ready``)
    # per sender, the digests that went ahead of its signal (``Digests``)
    parts: dict[str, list[wire.Digest]] = field(default_factory=dict)
    overflow: set[str] = field(default_factory=set)  # senders that sent too many digests
    unverifiable: dict[str, str] = field(default_factory=dict)  # sender: why (its signal in)
    digests: int = 0  # held here, signals' and parts' (``MAX_EARLY_DIGESTS``)

    def add_signal(self, sig: wire.Signal, wall: float, now: float) -> bool:
        """Take ``sig`` in, with the digests that went ahead of it. False: ignored (a
        duplicate, or more senders than P has ranks)."""
        if sig.sender in self.by_sender or len(self.by_sender) >= MAX_SENDERS:
            return False
        self.by_sender[sig.sender] = self.whole(sig)
        self.last_wall = wall
        if sig.settle_s > 0:
            self.settle_until = max(self.settle_until, now + sig.settle_s)
        return True

    def add_digests(self, part: wire.Digests) -> None:
        """Digests of the transfer's pieces that went ahead of their sender's done signal."""
        if part.sender in self.by_sender:
            return  # after its signal: not P's
        if part.sender not in self.parts and len(self.parts) >= MAX_SENDERS:
            return  # more senders than P has ranks
        held = self.parts.setdefault(part.sender, [])
        if len(held) + len(part.digests) > wire.MAX_DIGESTS_PER_SENDER:
            self.overflow.add(part.sender)
            held.clear()
        elif part.sender not in self.overflow:
            held.extend(part.digests)

    def whole(self, sig: wire.Signal) -> wire.Signal:
        """``sig`` with the digests that went ahead of it; a sender whose digests did not all
        arrive is noted as unverifiable."""
        ahead = self.parts.pop(sig.sender, [])
        got = len(ahead) + len(sig.digests)
        want = sig.digest_count if sig.digest_count or ahead else got
        if sig.sender in self.overflow:
            self.unverifiable[sig.sender] = f"more than {wire.MAX_DIGESTS_PER_SENDER} digests"
        elif got != want:
            self.unverifiable[sig.sender] = f"{got} of its {want} digests arrived"
        if not ahead:
            return sig
        ahead.extend(sig.digests)
        return msgspec.structs.replace(sig, digests=ahead)


class Inbox:
    """The ``Arrivals`` of each transfer D heard of, by transfer id (early ones included)."""

    def __init__(self, early_max: int = MAX_EARLY, early_digests_max: int = MAX_EARLY_DIGESTS):
        self._entries: dict[str, Arrivals] = {}
        # the early ones (no request expects them yet), oldest first: their expiry order
        self._early: collections.OrderedDict[str, None] = collections.OrderedDict()
        self._early_max = early_max
        self._early_digests_max = early_digests_max
        self._early_digests = 0  # held by early entries
        self.dropped = 0  # early entries dropped to make room

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, tid: str) -> Arrivals | None:
        return self._entries.get(tid)

    def early(self) -> int:
        """Transfers with signals or keep-alives no request expects yet."""
        return len(self._early)

    def entry(self, tid: str, now: float, digests: int = 0, *, expected: bool) -> Arrivals | None:
        """The arrivals of ``tid``, which ``digests`` more digests are about to join; a new
        entry for a transfer no request expects yet (not ``expected``) is early:
        ``MAX_EARLY`` of them and ``MAX_EARLY_DIGESTS`` digests at most, the oldest making
        room (``None``: this one went too)."""
        entry = self._entries.get(tid)
        if entry is None:
            entry = self._entries[tid] = Arrivals(now)
            if not expected:
                self._early[tid] = None
        entry.digests += digests
        if tid in self._early:
            self._early_digests += digests
            while len(self._early) > self._early_max or (
                self._early_digests > self._early_digests_max
            ):
                oldest, _ = self._early.popitem(last=False)
                self._early_digests -= self._entries.pop(oldest).digests
                self._dropped_early()
        return self._entries.get(tid)

    def claim(self, tid: str) -> None:
        """A request expects ``tid`` now: its early arrivals are no longer early."""
        if self._early.pop(tid, 0) is None:
            self._early_digests -= self._entries[tid].digests

    def expire(self, now: float, timeout: float) -> None:
        """Drop early entries nobody claimed by the deadline: from the oldest, up to the first
        still within it (arrival order is expiry order)."""
        while self._early:
            tid = next(iter(self._early))
            entry = self._entries.get(tid)
            if entry is not None and now - entry.first_at <= timeout:
                return
            del self._early[tid]
            if entry is not None:
                del self._entries[tid]
                self._early_digests -= entry.digests

    def drop(self, tid: str) -> None:
        """The transfer's load ended: forget what arrived for it."""
        self._entries.pop(tid, None)
        self._early.pop(tid, None)

    def _dropped_early(self) -> None:
        self.dropped += 1
        if self.dropped == 1:  # once: a flood would otherwise flood the log too
            log.warning(
                "side channel: more than %d transfers not expected (yet) have signals or "
                "keep-alives here; the oldest are dropped (logged once): a flood, or P far "
                "ahead of D",
                self._early_max,
            )
