"""P's half of the digests (``verify_kv``, or proof of arrival): sign what was written.

After each write P records every piece of it with a CRC32 of its source (``record``). At the
end (``digests``): with ``recheck`` (``verify_kv``) the sources are read again, so the digests
describe P's KV after the prefill and a source that changed after its push is logged; without
it (arrival digests over a transport whose writes finish before they land) the CRCs taken at
write time are sent as they are. See digest.py for D's half.
"""

from __future__ import annotations

import logging

from connector.worker import digest
from connector.worker.batch import Part
from connector.worker.transfer import Transfer

log = logging.getLogger("pdgate.connector.sender")


class Signer:
    def __init__(self, checksums: digest.Checksums, recheck: bool) -> None:
        self._checksums = checksums  # reads P's KV (host or device memory)
        self._recheck = recheck

    def record(self, tr: Transfer, part: Part) -> None:
        src, dst, lengths = part.pieces
        crcs = self._checksums(list(zip(src, lengths, strict=True)))
        for s, d, n, c in zip(src, dst, lengths, crcs, strict=True):
            tr.written.append(digest.Written(part.d_layer, s, d, n, c))

    def digests(self, tr: Transfer) -> list[digest.Digest]:
        if not self._recheck:  # digests as proof of arrival: the CRCs taken at write time
            return [(w.layer, w.dst, w.length, w.crc) for w in tr.written]
        digests, changed = digest.sign(tr.written, self._checksums)
        if changed:
            first = changed[0]
            log.error(
                "transfer %s (%s): %d pushed piece(s) of P's KV changed after the push, first "
                "D layer #%d at P %#x+%d: a block was pushed before its KV was final or reused",
                tr.transfer_id,
                tr.req_id,
                len(changed),
                first.layer,
                first.src,
                first.length,
            )
        return digests
