"""How a load D waits for stands at a poll: all its KV arrived, it failed, or it keeps waiting.

``Judge.verdict`` weighs one request's ``Load`` against what arrived for its transfer
(arrivals.py), in this order: a load released or whose binding was rejected fails at once; a
P rank's failed write that may still land holds the blocks (``settle_s``) before anything is
decided; a P rank that reported its push failed fails the load; once every P rank signalled,
the load is intact — with ``verify``, only if what landed matches their digests; a P silent
for ``silence_s`` (no keep-alive) fails it, and so does the deadline.

With digests in the signals (``verify_kv``, or always over a transport whose writes finish
before they land, like Mooncake tcp), a mismatch first means "not landed yet": the load keeps
waiting and is re-checked every poll for up to ``landing_wait_s`` (never past its deadline);
only then is it failed as corrupt. A sender whose digests did not all arrive fails the load
(``unverified``), and so does a signal without digests for a transfer whose other signals have
them, or any unsigned one when D checks every load (``require_digests``: D's ``verify_kv``).

Runs under the tracker's lock, on vLLM's forward thread (``RecvTracker.poll``).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

from connector import wire
from connector.stats import StatsCollector
from connector.untrusted import shown
from connector.worker.arrivals import Arrivals

log = logging.getLogger("pdgate.connector.receiver")


@dataclass
class Load:
    """A request D waits for the KV of, from ``RecvTracker.expect`` until a poll ends it."""

    req_id: str
    transfer_id: str
    deadline: float
    aborted: bool = False
    released: bool = False  # aborted before P took the binding: nothing can land any more
    rejected: bool = False  # the binding was rejected: P cannot have it (``RecvTracker.fail``)
    signalled_at: float | None = None  # all done signals in, digests not matching yet
    settling: bool = False  # holding the blocks for a failed write's late pieces (logged once)
    held: bool = False  # failed while P may still write: see ``RecvTracker.take_silent``
    cause: str = "timeout"  # why the load failed (a ``load_failures`` label)


class Judge:
    """The verdict on each load at a poll, and the counts of how loads ended."""

    def __init__(
        self, timeout_s: float, silence_s: float, landing_wait_s: float, stats: StatsCollector
    ) -> None:
        self.stats = stats
        self._timeout = timeout_s
        self._silence = silence_s
        self._landing_wait = landing_wait_s
        # ``verify_kv``: checks a complete transfer's digests ("" = the KV landed intact)
        self.verify: Callable[[wire.Signal], str] | None = None
        # every load must come signed (D's ``verify_kv``), not only those P chose to sign
        self.require_digests = False
        self.expired = 0
        self.corrupt = 0
        self.verified = 0  # transfers whose digests all matched
        self.late_landings = 0  # of those: matched only after their done signals
        self.silent = 0  # loads failed because P stopped sending keep-alives
        self.unverified = 0  # loads failed because their digests did not all arrive

    def verdict(self, recv: Load, entry: Arrivals | None, now: float) -> bool | None:
        """True: all KV arrived; False: failed or expired; None: keep waiting."""
        if recv.released:
            return False
        if recv.rejected:
            recv.cause = "binding_rejected"
            return False
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
            recv.held = True
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
                recv.held = True
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

    def _intact(self, recv: Load, entry: Arrivals, now: float) -> bool | None:
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

    def _unsigned(self, entry: Arrivals) -> str | None:
        """The sender of a signal that skips the check of a transfer that has one: a
        transfer is checked whole once any of its signals is signed, or always (``require_
        digests``)."""
        sigs = entry.by_sender.values()
        signed = [s.signed or bool(s.digests) for s in sigs]
        if not (self.require_digests or any(signed)):
            return None
        return next((s.sender for s, ok in zip(sigs, signed, strict=True) if not ok), None)
