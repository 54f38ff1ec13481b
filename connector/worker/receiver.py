"""D side bookkeeping: which requests wait for KV, their done signals, their deadlines.

Signals are counted per transfer id and sender. One that arrives before the request is known
is buffered (for up to the deadline), and so is a keep-alive; at most ``MAX_EARLY`` transfers
are held so, the oldest dropped first (a flood from whoever reaches the side channel), in
arrival order, which is also their expiry order: ``poll`` drops the expired ones from the
front and never looks at the rest. One for a transfer already finished (late, duplicate, an
old attempt) is ignored. A request whose signals do not all arrive by its deadline is reported
failed, so vLLM recomputes or fails it; an aborted request is released (without failure) once P
confirmed or the deadline passed — until then P may still be writing its blocks — or at once
when the scheduler says P never took the binding (``release``).

With digests in the signals (``verify_kv``, or always over a transport whose writes finish
before they land, like Mooncake tcp), a mismatch first means "not landed yet": the request keeps
waiting and is re-checked every poll for up to ``landing_wait_s`` (never past its deadline);
only then is the load failed as corrupt. Digests that did not fit in a signal arrive ahead of
it (``Digests``); a sender whose digests did not all arrive fails the load (``unverified``), and
so does a signal without digests for a transfer whose other signals have them, or any unsigned
one when D checks every load (``require_digests``: D's ``verify_kv``).
Early entries hold ``MAX_EARLY_DIGESTS`` digests at most, all together.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import NamedTuple

import msgspec

from connector import wire
from connector.stats import StatsCollector
from connector.untrusted import shown
from pdwire.models import MAX_TP_SIZE

log = logging.getLogger("pdgate.connector.receiver")


NO_PREFILL = "none"  # the load failed before any P signalled
UNKNOWN_PREFILL = "unknown"  # a P whose signals do not name its instance
# Transfers D holds signals or keep-alives for before it expects them: P is rarely ahead of
# D's own scheduler by more than a step, so a few thousand is a flood, not a backlog
MAX_EARLY = 4096
# Done signals one transfer may have: one per P rank writing into this D rank at most
MAX_SENDERS = MAX_TP_SIZE
# Digests held for early entries, all together (about 180 bytes each in Python: ~190 MB)
MAX_EARLY_DIGESTS = 1 << 20


class Source(NamedTuple):
    """Where a finished load came from and how it ended (``RecvTracker.take_sources``)."""

    prefill: str  # the P instance id, ``none`` or ``unknown``
    intact: bool  # False: failed (D recomputes or fails the request)


@dataclass
class _Recv:
    req_id: str
    transfer_id: str
    deadline: float
    aborted: bool = False
    released: bool = False  # aborted before P took the binding: nothing can land any more
    signalled_at: float | None = None  # all done signals in, digests not matching yet
    settling: bool = False  # holding the blocks for a failed write's late pieces (logged once)
    cause: str = "timeout"  # why the load failed (a ``load_failures`` label)


@dataclass
class _Signals:
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


class RecvTracker:
    def __init__(
        self,
        timeout_s: float,
        clock: Callable[[], float] = time.monotonic,
        retired_max: int = 65_536,
        landing_wait_s: float = 10.0,
        silence_s: float = 0.0,
        stats: StatsCollector | None = None,
        wall: Callable[[], float] = time.time,
        early_max: int = MAX_EARLY,
        early_digests_max: int = MAX_EARLY_DIGESTS,
    ) -> None:
        self.stats = stats or StatsCollector()
        self._wall = wall
        self._timeout = timeout_s
        self._silence = silence_s
        self._landing_wait = landing_wait_s
        self._clock = clock
        self._lock = threading.Lock()
        self._recvs: dict[str, _Recv] = {}  # by req id
        self._tid_to_req: dict[str, str] = {}
        self._signals: dict[str, _Signals] = {}  # by transfer id (early ones included)
        # the early ones (no request expects them yet), oldest first: their expiry order
        self._early: collections.OrderedDict[str, None] = collections.OrderedDict()
        self._early_max = early_max
        self._early_digests_max = early_digests_max
        self._early_digests = 0  # held by early entries
        self.early_dropped = 0
        self._retired: collections.OrderedDict[str, None] = collections.OrderedDict()
        self._retired_max = retired_max
        self._failed_now: set[str] = set()
        self.ignored_signals = 0
        self.expired = 0
        self.corrupt = 0
        self.verified = 0  # transfers whose digests all matched
        self.late_landings = 0  # of those: matched only after their done signals
        self.silent = 0  # loads failed because P stopped sending keep-alives
        self.unverified = 0  # loads failed because their digests did not all arrive
        self._quarantine: set[str] = set()  # failed while P may still write: see ``take_silent``
        self._ready: dict[str, float] = {}  # see ``take_ready``
        self._sources: dict[str, Source] = {}  # see ``take_sources``
        # ``verify_kv``: checks a complete transfer's digests ("" = the KV landed intact)
        self.verify: Callable[[wire.Signal], str] | None = None
        # every load must come signed (D's ``verify_kv``), not only those P chose to sign
        self.require_digests = False
        # a load completed intact (counts its bytes); runs under the tracker's lock
        self.on_landed: Callable[[str], None] | None = None

    def expect(self, req_id: str, transfer_id: str) -> None:
        with self._lock:
            if req_id in self._recvs or transfer_id in self._retired:
                return
            self._recvs[req_id] = _Recv(req_id, transfer_id, self._clock() + self._timeout)
            self._tid_to_req[transfer_id] = req_id
            if self._early.pop(transfer_id, 0) is None:  # its early signals are expected now
                self._early_digests -= self._signals[transfer_id].digests

    def fail(self, req_id: str) -> None:
        """The binding was rejected: P cannot have it, so fail without waiting."""
        with self._lock:
            if req_id in self._recvs:
                self._failed_now.add(req_id)

    def aborted(self, req_ids: set[str]) -> None:
        with self._lock:
            for req_id in req_ids:
                recv = self._recvs.get(req_id)
                if recv is not None:
                    recv.aborted = True

    def release(self, req_ids: Iterable[str]) -> None:
        """Aborted requests whose binding ended before P took it: finish them now."""
        with self._lock:
            for req_id in req_ids:
                recv = self._recvs.get(req_id)
                if recv is not None:
                    recv.aborted = recv.released = True

    def on_signal(self, sig: wire.Signal) -> None:
        log.debug(
            "signal %s from %s ok=%s expected=%d",
            sig.transfer_id,
            shown(sig.sender),
            sig.ok,
            sig.expected,
        )
        with self._lock:
            if sig.transfer_id in self._retired:
                self.ignored_signals += 1
                return
            entry = self._entry(sig.transfer_id, self._clock(), len(sig.digests))
            if entry is None:
                return  # dropped at once: more early digests than held in all
            if sig.sender in entry.by_sender or len(entry.by_sender) >= MAX_SENDERS:
                self.ignored_signals += 1  # a duplicate, or more senders than P has ranks
                return
            entry.by_sender[sig.sender] = self._whole(entry, sig)
            entry.last_wall = self._wall()
            if sig.settle_s > 0:
                entry.settle_until = max(entry.settle_until, self._clock() + sig.settle_s)

    def on_alive(self, alive: wire.Alive) -> None:
        now = self._clock()
        with self._lock:
            for tid in alive.transfer_ids:
                if tid in self._retired:
                    continue
                entry = self._entry(tid, now)
                if entry is not None:
                    entry.alive_at = now

    def on_digests(self, part: wire.Digests) -> None:
        """Digests of a transfer's pieces that went ahead of its sender's done signal."""
        with self._lock:
            if part.transfer_id in self._retired:
                return
            entry = self._entry(part.transfer_id, self._clock(), len(part.digests))
            if entry is None or part.sender in entry.by_sender:
                return  # dropped (early, too many), or after its signal: not P's
            if part.sender not in entry.parts and len(entry.parts) >= MAX_SENDERS:
                return  # more senders than P has ranks
            held = entry.parts.setdefault(part.sender, [])
            if len(held) + len(part.digests) > wire.MAX_DIGESTS_PER_SENDER:
                entry.overflow.add(part.sender)
                held.clear()
            elif part.sender not in entry.overflow:
                held.extend(part.digests)

    def digest_senders(self, tid: str) -> int:
        """Senders whose digests of ``tid`` arrived ahead of their signal."""
        with self._lock:
            entry = self._signals.get(tid)
            return 0 if entry is None else len(entry.parts)

    @staticmethod
    def _whole(entry: _Signals, sig: wire.Signal) -> wire.Signal:
        """``sig`` with the digests that went ahead of it; a sender whose digests did not all
        arrive is noted as unverifiable. Under the lock."""
        ahead = entry.parts.pop(sig.sender, [])
        got = len(ahead) + len(sig.digests)
        want = sig.digest_count if sig.digest_count or ahead else got
        if sig.sender in entry.overflow:
            entry.unverifiable[sig.sender] = f"more than {wire.MAX_DIGESTS_PER_SENDER} digests"
        elif got != want:
            entry.unverifiable[sig.sender] = f"{got} of its {want} digests arrived"
        if not ahead:
            return sig
        ahead.extend(sig.digests)
        return msgspec.structs.replace(sig, digests=ahead)

    def _entry(self, tid: str, now: float, digests: int = 0) -> _Signals | None:
        """The signals of ``tid``, which ``digests`` more digests are about to join; a new
        entry for a transfer no request expects yet is early: ``MAX_EARLY`` of them and
        ``MAX_EARLY_DIGESTS`` digests at most, the oldest making room (``None``: this one
        went too). Under the lock."""
        entry = self._signals.get(tid)
        if entry is None:
            entry = self._signals[tid] = _Signals(now)
            if tid not in self._tid_to_req:
                self._early[tid] = None
        entry.digests += digests
        if tid in self._early:
            self._early_digests += digests
            while len(self._early) > self._early_max or (
                self._early_digests > self._early_digests_max
            ):
                oldest, _ = self._early.popitem(last=False)
                self._early_digests -= self._signals.pop(oldest).digests
                self._dropped_early()
        return self._signals.get(tid)

    def _dropped_early(self) -> None:
        self.early_dropped += 1
        if self.early_dropped == 1:  # once: a flood would otherwise flood the log too
            log.warning(
                "side channel: more than %d transfers not expected (yet) have signals or "
                "keep-alives here; the oldest are dropped (logged once): a flood, or P far "
                "ahead of D",
                self._early_max,
            )

    def early_held(self) -> int:
        """Transfers with signals or keep-alives no request expects yet."""
        with self._lock:
            return len(self._early)

    def take_silent(self) -> set[str]:
        """Req ids failed since the last call while P may still write: for P's silence (P may
        only be frozen), or at the deadline after P had spoken (a write in flight can land
        later). Their blocks must stay out of use until the deadline plus the late-landing
        hold."""
        with self._lock:
            silent, self._quarantine = self._quarantine, set()
        return silent

    def take_ready(self) -> dict[str, float]:
        """Loads that ended intact since the last call (aborted ones left out), each with the
        wall-clock time its KV was all there: its last done signal's arrival, or the poll that
        found it landed when it had to wait for late bytes or a settle hold. The scheduler half
        times from there to the request's first step (``kv_ready_wait_seconds``)."""
        with self._lock:
            ready, self._ready = self._ready, {}
        return ready

    def take_sources(self) -> dict[str, Source]:
        """Loads that ended since the last call, intact or failed (aborted ones left out):
        which P instance they came from, and how they ended."""
        with self._lock:
            sources, self._sources = self._sources, {}
        return sources

    def pending(self) -> int:
        with self._lock:
            return len(self._recvs)

    def poll(self) -> tuple[set[str], set[str]]:
        """(finished, failed): failed ids are in finished too, as vLLM expects."""
        now = self._clock()
        finished: set[str] = set()
        failed: set[str] = set()
        with self._lock:
            for req_id, recv in list(self._recvs.items()):
                verdict = self._verdict(recv, now)
                if verdict is None:
                    continue
                finished.add(req_id)
                if verdict:
                    self.stats.add("loads")
                    if not recv.aborted:
                        self._ready[req_id] = self._ready_at(recv)
                        if len(self._ready) > self._retired_max:  # nobody takes them
                            del self._ready[next(iter(self._ready))]
                    if self.on_landed is not None:
                        self.on_landed(req_id)
                elif not recv.aborted:
                    failed.add(req_id)
                    self.stats.add("load_failures", label=recv.cause)
                if not recv.aborted:
                    self._sources[req_id] = Source(self._prefill_of(recv), bool(verdict))
                    if len(self._sources) > self._retired_max:  # nobody takes them
                        del self._sources[next(iter(self._sources))]
                self._retire(recv)
            self._expire_early(now)
        return finished, failed

    def _expire_early(self, now: float) -> None:
        """Drop early entries nobody claimed by the deadline: from the oldest, up to the first
        still within it (arrival order is expiry order). Under the lock."""
        while self._early:
            tid = next(iter(self._early))
            entry = self._signals.get(tid)
            if entry is not None and now - entry.first_at <= self._timeout:
                return
            del self._early[tid]
            if entry is not None:
                del self._signals[tid]
                self._early_digests -= entry.digests

    def _verdict(self, recv: _Recv, now: float) -> bool | None:
        """True: all KV arrived; False: failed or expired; None: keep waiting."""
        if recv.released:
            return False
        if recv.req_id in self._failed_now:
            recv.cause = "binding_rejected"
            return False
        entry = self._signals.get(recv.transfer_id)
        if entry is not None and entry.by_sender and now < entry.settle_until:
            if not recv.settling:
                recv.settling = True
                self.stats.add("late_landing_holds", label="decode")
                log.warning(
                    "transfer %s (%s): a write from P failed and may still land; holding its "
                    "blocks %.1fs before %s",
                    recv.transfer_id,
                    recv.req_id,
                    entry.settle_until - now,
                    "failing the load"
                    if any(not s.ok for s in entry.by_sender.values())
                    else "using them",
                )
            return None
        if entry is not None and entry.by_sender:
            sigs = entry.by_sender.values()
            failed = [s for s in sigs if not s.ok]
            if failed:
                recv.cause = "prefill_failed"
                log.warning(
                    "transfer %s (%s): P reported its push failed (%s); failing the load",
                    recv.transfer_id,
                    recv.req_id,
                    "; ".join(
                        f"{shown(s.sender)}: {shown(s.error) if s.error else 'no reason given'}"
                        for s in failed[:4]
                    ),
                )
                return False
            if len(entry.by_sender) >= max(s.expected for s in sigs):
                return self._intact(recv, entry, now)
        alive_at = entry.alive_at if entry is not None else None
        # (an aborted request has no answer to hurry: it keeps waiting for P or the deadline)
        silent = alive_at is not None and now - alive_at >= self._silence
        if self._silence and silent and not recv.aborted:
            self.silent += 1
            recv.cause = "prefill_silent"
            self._quarantine.add(recv.req_id)
            log.warning(
                "transfer %s (%s): no word from P for %.1fs (killed or frozen?); failing the "
                "load; its blocks stay out of use until the deadline and the late-landing hold",
                recv.transfer_id,
                recv.req_id,
                now - (alive_at or now),
            )
            return False
        if now >= recv.deadline:
            self.expired += 1
            recv.cause = "timeout"
            got = len(entry.by_sender) if entry is not None else 0
            # P said something, so it was pushing: a write it started before its cutoff (D's
            # deadline less a margin) can land up to its write deadline plus the late-landing
            # hold later, into blocks vLLM would otherwise recompute or reuse at once (a CI
            # run: a retried write landed after the recompute, and D's answer was wrong)
            pushing = entry is not None
            if pushing:
                self._quarantine.add(recv.req_id)
            log.warning(
                "transfer %s (%s): %d done signal(s) by the %.0fs deadline; failing the load%s",
                recv.transfer_id,
                recv.req_id,
                got,
                self._timeout,
                "; its blocks stay out of use for the late-landing hold" if pushing else "",
            )
            return False
        return None

    def _intact(self, recv: _Recv, entry: _Signals, now: float) -> bool | None:
        """With ``verify``: whether what landed matches every P rank's digests (None: not yet,
        keep waiting — bytes may still be on their way)."""
        if self.verify is None:
            return True
        for sender, why in entry.unverifiable.items():
            self.unverified += 1
            recv.cause = "unverified"
            log.error(
                "transfer %s (%s): the KV from %s cannot be checked: %s; failing the load",
                recv.transfer_id,
                recv.req_id,
                shown(sender),
                why,
            )
            return False
        unsigned = self._unsigned(entry)
        if unsigned is not None:
            self.unverified += 1
            recv.cause = "unverified"
            log.error(
                "transfer %s (%s): the done signal of %s carries no digests, %s; failing the load",
                recv.transfer_id,
                recv.req_id,
                shown(unsigned),
                "while D checks every load (verify_kv)"
                if self.require_digests
                else "while the transfer's other signals do",
            )
            return False
        checked = False
        for sig in entry.by_sender.values():
            if not sig.digests:
                continue  # signed, but nothing written
            checked = True
            problem = self.verify(sig)
            if not problem:
                continue
            if recv.signalled_at is None:
                recv.signalled_at = now
            if now - recv.signalled_at < self._landing_wait and now < recv.deadline:
                return None
            self.corrupt += 1
            recv.cause = "corrupt"
            log.error(
                "transfer %s (%s): KV from %s does not match what P pushed %.1fs after its done "
                "signal: %s; failing the load",
                recv.transfer_id,
                recv.req_id,
                shown(sig.sender),
                now - recv.signalled_at,
                problem,
            )
            return False
        if recv.signalled_at is not None:
            self.late_landings += 1
            self.stats.add("late_arrivals")
            log.info(
                "transfer %s (%s): KV landed %.1f ms after its done signal (which overtook it)",
                recv.transfer_id,
                recv.req_id,
                (now - recv.signalled_at) * 1e3,
            )
        self.verified += checked
        return True

    def _unsigned(self, entry: _Signals) -> str | None:
        """The sender of a signal that skips the check of a transfer that has one: a
        transfer is checked whole once any of its signals is signed, or always (``require_
        digests``)."""
        sigs = entry.by_sender.values()
        signed = [s.signed or bool(s.digests) for s in sigs]
        if not (self.require_digests or any(signed)):
            return None
        return next((s.sender for s, ok in zip(sigs, signed, strict=True) if not ok), None)

    def _prefill_of(self, recv: _Recv) -> str:
        """The P instance a load came from: as its done signals name it; ``unknown`` when they
        do not (an older P), ``none`` when no P signalled."""
        entry = self._signals.get(recv.transfer_id)
        if entry is None or not entry.by_sender:
            return NO_PREFILL
        return next((s.instance for s in entry.by_sender.values() if s.instance), UNKNOWN_PREFILL)

    def _ready_at(self, recv: _Recv) -> float:
        entry = self._signals.get(recv.transfer_id)
        if entry is None or recv.signalled_at is not None or recv.settling:
            return self._wall()
        return entry.last_wall

    def _retire(self, recv: _Recv) -> None:
        del self._recvs[recv.req_id]
        self._failed_now.discard(recv.req_id)
        self._tid_to_req.pop(recv.transfer_id, None)
        self._signals.pop(recv.transfer_id, None)
        self._early.pop(recv.transfer_id, None)
        self._retired[recv.transfer_id] = None
        while len(self._retired) > self._retired_max:
            self._retired.popitem(last=False)
