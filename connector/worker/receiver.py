"""D side bookkeeping: which requests wait for KV, their done signals, their deadlines.

``RecvTracker`` is what the worker half (half.py) and the side channel (side_channel.py) call.
A request the scheduler half says will load (``expect``) waits until its transfer's done signals
are all in and its KV landed intact, or until it fails; each ``poll`` asks the verdict on each
waiting load (verdict.py) and reports the loads that ended, as vLLM expects them.

Signals, keep-alives and digests are held per transfer id and sender (arrivals.py), those that
arrive before the request is known included (early, for up to the deadline; bounded). One for a
transfer already finished (late, duplicate, an old attempt) is ignored. A request whose signals
do not all arrive by its deadline is reported failed, so vLLM recomputes or fails it; an aborted
request is released (without failure) once P confirmed or the deadline passed — until then P
may still be writing its blocks — or at once when the scheduler says P never took the binding
(``release``).

Two threads call it, under one lock: the side-channel thread (``on_signal``, ``on_alive``,
``on_digests``) and vLLM's forward thread (the rest, through the worker half).
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Callable, Iterable
from typing import NamedTuple

from connector import wire
from connector.stats import StatsCollector
from connector.untrusted import shown
from connector.worker.arrivals import MAX_EARLY, MAX_EARLY_DIGESTS, Arrivals, Inbox
from connector.worker.verdict import Judge, Load

log = logging.getLogger("pdgate.connector.receiver")


NO_PREFILL = "none"  # the load failed before any P signalled
UNKNOWN_PREFILL = "unknown"  # a P whose signals do not name its instance


class Source(NamedTuple):
    """Where a finished load came from and how it ended (``RecvTracker.take_sources``)."""

    prefill: str  # the P instance id, ``none`` or ``unknown``
    intact: bool  # False: failed (D recomputes or fails the request)


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
        self._clock = clock
        self._lock = threading.Lock()
        self._judge = Judge(timeout_s, silence_s, landing_wait_s, self.stats)
        self._recvs: dict[str, Load] = {}  # by req id
        self._tid_to_req: dict[str, str] = {}
        self._signals = Inbox(early_max, early_digests_max)  # by transfer id
        self._retired: collections.OrderedDict[str, None] = collections.OrderedDict()
        self._retired_max = retired_max
        self.ignored_signals = 0
        self._quarantine: set[str] = set()  # failed while P may still write: see ``take_silent``
        self._ready: dict[str, float] = {}  # see ``take_ready``
        self._sources: dict[str, Source] = {}  # see ``take_sources``
        # a load completed intact (counts its bytes); runs under the tracker's lock
        self.on_landed: Callable[[str], None] | None = None

    # ---- what the worker half sets: how landed KV is checked --------------------------------
    @property
    def verify(self) -> Callable[[wire.Signal], str] | None:
        """``verify_kv``: checks a complete transfer's digests ("" = the KV landed intact)."""
        return self._judge.verify

    @verify.setter
    def verify(self, check: Callable[[wire.Signal], str] | None) -> None:
        self._judge.verify = check

    @property
    def require_digests(self) -> bool:
        """Every load must come signed (D's ``verify_kv``), not only those P chose to sign."""
        return self._judge.require_digests

    @require_digests.setter
    def require_digests(self, required: bool) -> None:
        self._judge.require_digests = required

    # ---- how loads ended (verdict.py counts) ----------------------------------------------
    @property
    def expired(self) -> int:
        return self._judge.expired

    @property
    def corrupt(self) -> int:
        return self._judge.corrupt

    @property
    def verified(self) -> int:
        """Transfers whose digests all matched."""
        return self._judge.verified

    @property
    def late_landings(self) -> int:
        """Of the verified: matched only after their done signals."""
        return self._judge.late_landings

    @property
    def silent(self) -> int:
        """Loads failed because P stopped sending keep-alives."""
        return self._judge.silent

    @property
    def unverified(self) -> int:
        """Loads failed because their digests did not all arrive."""
        return self._judge.unverified

    @property
    def early_dropped(self) -> int:
        """Early entries dropped to make room (arrivals.py)."""
        return self._signals.dropped

    # ---- the forward thread: loads in --------------------------------------------------------
    def expect(self, req_id: str, transfer_id: str) -> None:
        with self._lock:
            if req_id in self._recvs or transfer_id in self._retired:
                return
            self._recvs[req_id] = Load(req_id, transfer_id, self._clock() + self._timeout)
            self._tid_to_req[transfer_id] = req_id
            self._signals.claim(transfer_id)  # its early signals are expected now

    def fail(self, req_id: str) -> None:
        """The binding was rejected: P cannot have it, so fail without waiting."""
        with self._lock:
            recv = self._recvs.get(req_id)
            if recv is not None:
                recv.rejected = True

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

    # ---- the side-channel thread: what P's ranks send ----------------------------------------
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
            now = self._clock()
            entry = self._entry(sig.transfer_id, now, len(sig.digests))
            if entry is None:
                return  # dropped at once: more early digests than held in all
            if not entry.add_signal(sig, self._wall(), now):
                self.ignored_signals += 1  # a duplicate, or more senders than P has ranks

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
            if entry is not None:  # else dropped (early, too many)
                entry.add_digests(part)

    def _entry(self, tid: str, now: float, digests: int = 0) -> Arrivals | None:
        """Under the lock."""
        return self._signals.entry(tid, now, digests, expected=tid in self._tid_to_req)

    def digest_senders(self, tid: str) -> int:
        """Senders whose digests of ``tid`` arrived ahead of their signal."""
        with self._lock:
            entry = self._signals.get(tid)
            return 0 if entry is None else len(entry.parts)

    def early_held(self) -> int:
        """Transfers with signals or keep-alives no request expects yet."""
        with self._lock:
            return self._signals.early()

    # ---- the forward thread: loads out -------------------------------------------------------
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
                verdict = self._judge.verdict(recv, self._signals.get(recv.transfer_id), now)
                if verdict is None:
                    continue
                finished.add(req_id)
                if recv.held:
                    self._quarantine.add(req_id)
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
            self._signals.expire(now, self._timeout)
        return finished, failed

    def _prefill_of(self, recv: Load) -> str:
        """The P instance a load came from: as its done signals name it; ``unknown`` when they
        do not (an older P), ``none`` when no P signalled."""
        entry = self._signals.get(recv.transfer_id)
        if entry is None or not entry.by_sender:
            return NO_PREFILL
        return next((s.instance for s in entry.by_sender.values() if s.instance), UNKNOWN_PREFILL)

    def _ready_at(self, recv: Load) -> float:
        entry = self._signals.get(recv.transfer_id)
        if entry is None or recv.signalled_at is not None or recv.settling:
            return self._wall()
        return entry.last_wall

    def _retire(self, recv: Load) -> None:
        del self._recvs[recv.req_id]
        self._tid_to_req.pop(recv.transfer_id, None)
        self._signals.drop(recv.transfer_id)
        self._retired[recv.transfer_id] = None
        while len(self._retired) > self._retired_max:
            self._retired.popitem(last=False)
