"""TEST ONLY fault injection (``test_corrupt_push``): D receives KV that differs from P's.

The negative control of the end-to-end equality tests: it shows they can see a wrong transfer,
and that ``verify_kv`` catches one. Off by default; turning it on also needs the environment
variable ``PDGATE_ALLOW_TEST_HOOKS=1`` (checked when the settings are validated), and the worker
logs a warning at start.

P's own KV is never touched. The first piece P writes of its layer 0 for a transfer is sent, up
to one block's bytes, from a separate buffer filled with a constant byte (0x42: about 48.6 as
float32 or bfloat16, 3.1 as float16 — finite, and far from typical K/V values) instead of from
P's cache. So the bytes that land in D's first pushed block of layer 0 are wrong, while the
``verify_kv`` checksums — computed on P's cache — still describe the intended bytes and D fails
the load. Without ``verify_kv``, digests that P sends only as proof of arrival (over Mooncake tcp)
describe the bytes sent, garbage included, so D decodes from the wrong KV: the e2e tests see it.
"""

from __future__ import annotations

import ctypes
import logging

from connector.transport import Transport

log = logging.getLogger("pdgate.connector.tamper")

ALLOW_ENV = "PDGATE_ALLOW_TEST_HOOKS"
PATTERN = 0x42

Pieces = tuple[list[int], list[int], list[int]]  # sources, destinations, lengths


class Tamper:
    """A registered buffer of ``size`` pattern bytes and the piece lists that read from it."""

    def __init__(self, transport: Transport, size: int, who: str) -> None:
        if size <= 0:
            raise ValueError(f"corruption buffer size {size} must be positive")
        self._buf = (ctypes.c_ubyte * size)()
        ctypes.memset(self._buf, PATTERN, size)
        self.addr = ctypes.addressof(self._buf)
        self.size = size
        self.corrupted = 0  # pieces sent from the pattern buffer so far
        transport.register(self.addr, size)
        log.warning(
            "%s: TEST HOOK test_corrupt_push IS ON: the first block of layer 0 of every transfer "
            "is replaced by garbage on its way to D. Never use this outside tests.",
            who,
        )

    def apply(self, src: list[int], dst: list[int], lengths: list[int]) -> Pieces:
        """New lists in which the first piece's first ``size`` bytes come from the buffer."""
        if not src:
            return src, dst, lengths
        s, d, n = src[0], dst[0], lengths[0]
        k = min(n, self.size)
        head_src, head_dst, head_len = [self.addr], [d], [k]
        if n > k:  # the rest of a coalesced piece goes out intact
            head_src.append(s + k)
            head_dst.append(d + k)
            head_len.append(n - k)
        self.corrupted += 1
        return head_src + src[1:], head_dst + dst[1:], head_len + lengths[1:]
