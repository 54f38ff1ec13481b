"""What the security checks on the request path cost, each against its baseline in the same run.

    .venv/bin/python tests/bench/checks_bench.py [--seconds 0.5]

Rows (median of 5 timings, microseconds per call):
- metaserver: finding the caller of a write (``Access.who``) with one token, and with roles
  (50 credentials), against the one constant-time comparison it replaced;
- a vllm-ascend D callback: the proxy's capability for a request, the metaserver's check;
- proxy: reading the decode a binding names before P is sent it (``binding_foreign``), against
  passing the binding on unread;
- P: comparing the binding in its request with the record its claim returned (64 blocks).
"""

from __future__ import annotations

import argparse
import hmac
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import msgspec

from metaserver.access import Access, CredentialEntry, Role
from pdwire.ascend import capability
from pdwire.models import Binding, BindingSpec, KVEndpoint
from proxy.flows.decode_first import _names
from tests.support.access import resolved

TOKEN = "t" * 48
HEADER = f"Bearer {TOKEN}".encode()


def per_call_us(fn: Callable[[], object], seconds: float) -> float:
    """Median over 5 timings of ``fn``'s cost, each timing about ``seconds / 5`` long."""
    n = 1
    while True:  # calls per timing
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        if time.perf_counter() - t0 > seconds / 50:
            break
        n *= 2
    n = max(1, int(n * 10))
    samples = []
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        samples.append((time.perf_counter() - t0) / n * 1e6)
    return statistics.median(samples)


def binding(blocks: int = 64) -> Binding:
    spec = BindingSpec(
        request_id="chatcmpl-bench",
        decode_instance_id="decode-0",
        engine_id="d0",
        kv_endpoint=KVEndpoint(host="10.0.0.7", port=5600),
        block_size=16,
        block_ids=[list(range(100, 100 + blocks))],
        num_prompt_tokens=blocks * 16,
        load_deadline=1.8e9,
    )
    now = time.time()
    return Binding(
        **spec.model_dump(),
        transfer_id="pd-bench",
        state="bound",
        created_at=now,
        updated_at=now,
        events=[],
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seconds", type=float, default=0.5, help="per row and side")
    s = p.parse_args().seconds

    single = Access(token=TOKEN)
    entries = [
        CredentialEntry(name=f"e{i}", role=Role.ENGINE, instance=f"decode-{i}",
                        token=f"{Role.ENGINE.value}-{i}-" + "x" * 32)
        for i in range(49)
    ]  # fmt: skip
    roles = Access(token=TOKEN, entries=entries)
    expected = HEADER
    b = binding()
    raw = msgspec.Raw(b.model_dump_json().encode())
    same = Binding.model_validate_json(bytes(raw))
    key = TOKEN.encode()
    cap = capability(key, "pd-bench-1")

    rows = [
        ("metaserver: caller of a write", "compare_digest (before)",
         lambda: hmac.compare_digest(HEADER, expected),
         "who, single token", lambda: resolved(single, HEADER)),
        ("metaserver: caller of a write", "compare_digest (before)",
         lambda: hmac.compare_digest(HEADER, expected),
         "who, roles (50)", lambda: resolved(roles, HEADER)),
        ("ascend D callback", "no check (before: ?token=)", lambda: None,
         "proxy: capability", lambda: capability(key, "pd-bench-1")),
        ("ascend D callback", "no check (before: ?token=)", lambda: None,
         "metaserver: verify", lambda: roles.capability_ok("pd-bench-1", cap)),
        ("proxy: binding to P", "passed on unread (before)", lambda: None,
         "decode it names", lambda: _names.decode(raw)),
        ("P: claimed record", "not compared (before)", lambda: None,
         "differs_from (64 blocks)", lambda: same.differs_from(b)),
    ]  # fmt: skip
    print(f"{'path':<32} {'baseline':<28} {'µs':>7}   {'check':<26} {'µs':>7} {'added µs':>9}")
    for path, base_name, base, check_name, check in rows:
        before = per_call_us(base, s)
        after = per_call_us(check, s)
        print(
            f"{path:<32} {base_name:<28} {before:7.2f}   {check_name:<26} {after:7.2f} "
            f"{after - before:+9.2f}"
        )


if __name__ == "__main__":
    main()
