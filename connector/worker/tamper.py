"""TEST ONLY fault injection (``test_corrupt_push``): D receives KV that differs from P's.

The negative control of the end-to-end equality tests: it shows they can see a wrong transfer,
and that ``verify_kv`` catches one. Off by default; turning it on also needs the environment
variable ``PDGATE_ALLOW_TEST_HOOKS=1`` (checked when the settings are validated), and the worker
logs a warning at start.

It sits behind the transport seam: ``TamperingTransport`` wraps P's transport, and the worker
hands the sender the wrapper instead when the setting is on (worker/half.py); the sender does
not know. P's own KV is never touched. The first piece P writes of its layer 0 for a transfer is
sent, up to one block's bytes, from a separate buffer filled with a constant byte (0x42: about
48.6 as float32 or bfloat16, 3.1 as float16 — finite, and far from typical K/V values) instead
of from P's cache; the wrapper reads which transfer and layer each piece belongs to from the
write in flight (``writer.IN_FLIGHT``), and a retry resends the same bytes. So the bytes that
land in D's first pushed block of layer 0 are wrong, while the ``verify_kv`` checksums —
computed on P's cache — still describe the intended bytes and D fails the load. Without
``verify_kv``, digests that P sends only as proof of arrival (over Mooncake tcp) describe the
bytes sent, garbage included (the worker gives the sender ``sent_checksums``), so D decodes from
the wrong KV: the e2e tests see it.
"""

from __future__ import annotations

import ctypes
import logging
import weakref
import zlib

from connector.device import Pieces as Regions
from connector.transport import Transport
from connector.worker import digest
from connector.worker.batch import Pieces, Write
from connector.worker.transfer import Transfer
from connector.worker.writer import IN_FLIGHT

log = logging.getLogger("pdgate.connector.tamper")

ALLOW_ENV = "PDGATE_ALLOW_TEST_HOOKS"
PATTERN = 0x42


class TamperingTransport:
    """``inner``, but D gets ``size`` pattern bytes for the first layer-0 piece of each
    transfer (the buffer is registered with ``inner``: the transport may read from it)."""

    def __init__(self, inner: Transport, size: int, who: str) -> None:
        if size <= 0:
            raise ValueError(f"corruption buffer size {size} must be positive")
        self._inner = inner
        self._buf = (ctypes.c_ubyte * size)()
        ctypes.memset(self._buf, PATTERN, size)
        self.addr = ctypes.addressof(self._buf)
        self.size = size
        self.corrupted = 0  # pieces sent from the pattern buffer so far
        self._hit: weakref.WeakSet[Transfer] = weakref.WeakSet()  # their block went out wrong
        self._last: tuple[Write, Pieces] | None = None  # what the last write sent
        # (source, length) of the last write's pieces that began with the pattern -> its bytes
        self._sent: dict[tuple[int, int], list[int]] = {}
        inner.register(self.addr, size)
        log.warning(
            "%s: TEST HOOK test_corrupt_push IS ON: the first block of layer 0 of every transfer "
            "is replaced by garbage on its way to D. Never use this outside tests.",
            who,
        )

    # ---- Transport ------------------------------------------------------------------------
    @property
    def session(self) -> str:
        return self._inner.session

    def session_problem(self, session: str, host: str) -> str | None:
        return self._inner.session_problem(session, host)

    @property
    def lands_on_completion(self) -> bool:
        return self._inner.lands_on_completion

    @property
    def late_landing_s(self) -> float:
        return self._inner.late_landing_s

    def register(self, ptr: int, length: int) -> None:
        self._inner.register(ptr, length)

    def write(self, session: str, src: list[int], dst: list[int], lengths: list[int]) -> None:
        w = IN_FLIGHT.get()
        if w is not None and w.session == session and w.src is src:
            src, dst, lengths = self._tampered(w)
        self._inner.write(session, src, dst, lengths)

    def close(self) -> None:
        self._inner.close()

    # ---- the corruption -------------------------------------------------------------------
    def _tampered(self, w: Write) -> Pieces:
        """What ``w`` sends: each part that is its transfer's first of layer 0 corrupted."""
        if self._last is not None and self._last[0] is w:
            return self._last[1]  # a retry: the same bytes to the same places
        self._sent.clear()
        out = Pieces([], [], [])
        for part in w.parts:
            pieces = part.pieces
            tr = part.task.transfer
            if part.task.layer == 0 and tr not in self._hit:
                self._hit.add(tr)
                pieces = Pieces(*self.apply(*pieces))
                if part.pieces.src:
                    first = (part.pieces.src[0], part.pieces.lengths[0])
                    self._sent.setdefault(first, []).append(pieces.lengths[0])
            out.src.extend(pieces.src)
            out.dst.extend(pieces.dst)
            out.lengths.extend(pieces.lengths)
        self._last = (w, out)
        return out

    def apply(self, src: list[int], dst: list[int], lengths: list[int]) -> Pieces:
        """New lists in which the first piece's first ``size`` bytes come from the buffer."""
        if not src:
            return Pieces(src, dst, lengths)
        s, d, n = src[0], dst[0], lengths[0]
        k = min(n, self.size)
        head_src, head_dst, head_len = [self.addr], [d], [k]
        if n > k:  # the rest of a coalesced piece goes out intact
            head_src.append(s + k)
            head_dst.append(d + k)
            head_len.append(n - k)
        self.corrupted += 1
        return Pieces(head_src + src[1:], head_dst + dst[1:], head_len + lengths[1:])

    def sent_checksums(self, checksums: digest.Checksums) -> digest.Checksums:
        """``checksums`` of what the last write sent (arrival digests, taken right after each
        write): a piece that began with the pattern gets the CRC32 of the pattern bytes then
        the rest of its source."""

        def sent(regions: Regions) -> list[int]:
            heads = [self._pattern_bytes(addr, n) for addr, n in regions]
            rest = [(addr + k, n - k) for (addr, n), k in zip(regions, heads, strict=True)]
            crcs = checksums([(addr, n) for addr, n in rest if n > 0])[::-1]
            out: list[int] = []
            for k, (_, n) in zip(heads, rest, strict=True):
                tail = crcs.pop() if n > 0 else 0
                out.append(tail if k == 0 else _crc_then(zlib.crc32(bytes([PATTERN]) * k), tail, n))
            return out

        return sent

    def _pattern_bytes(self, addr: int, n: int) -> int:
        """How many leading bytes of the sent piece (``addr``, ``n``) came from the buffer."""
        pending = self._sent.get((addr, n))
        return pending.pop(0) if pending else 0


def _crc_then(head_crc: int, tail_crc: int, tail_len: int) -> int:
    """CRC32 of ``head + tail`` from the two CRCs (CRC32 is affine in its input):
    crc(h + t) = crc(h + zeros) ^ crc(t) ^ crc(zeros), zeros as long as ``t``."""
    if tail_len == 0:
        return head_crc
    zeros = bytes(tail_len)
    return zlib.crc32(zeros, head_crc) ^ tail_crc ^ zlib.crc32(zeros)
