"""``python3 -m connector.drain``: an engine's ``preStop`` hook (Kubernetes runs it before SIGTERM).

1. marks this instance ``draining`` on its metaserver registration
   (``PUT /v1/instances/{id}/drain``): every proxy stops sending it new requests within one
   registry poll (``--discovery-interval``, 5 s by default);
2. waits at least ``--settle`` seconds (for those polls), then until the engine is idle:
   ``vllm:num_requests_running`` + ``vllm:num_requests_waiting`` == 0 on its ``/metrics`` at
   two polls in a row (one second apart: a prefill's last push lands after its request ends),
   or ``--timeout`` seconds in all;
3. exits 0, whatever happened: termination must go on. SIGTERM then stops vLLM, and the
   connector deregisters the instance on shutdown.

Python rather than a shell script: the engine images have Python and pdgate, not curl. The
instance id defaults to ``$POD_NAME`` (the chart's ``instance_id``); the token is read from
``--token-file`` (a projected ServiceAccount token: read again if it changes meanwhile), else
``$PDGATE_METASERVER_TOKEN``.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import httpx

from connector.config import TOKEN_ENV
from pdwire.client import MetaserverClient, MetaserverClientError, NotFoundError, RetryPolicy
from pdwire.client.token import FileToken, Token

log = logging.getLogger("pdgate.connector.drain")
BUSY = ("vllm:num_requests_running", "vllm:num_requests_waiting")


def busy_requests(metrics_text: str) -> float:
    """Running + waiting requests in a vLLM ``/metrics`` page (summed over its engines)."""
    total = 0.0
    for line in metrics_text.splitlines():
        if line.split("{", 1)[0].split(" ", 1)[0] in BUSY:
            total += float(line.rsplit(" ", 1)[1])
    return total


@dataclass(frozen=True, slots=True)
class DrainReport:
    marked: bool  # the registration now says draining
    idle: bool  # the engine was seen idle (False: --timeout ran out)
    waited_s: float


def drain(
    client: MetaserverClient,
    instance_id: str,
    engine_url: str,
    *,
    settle_s: float,
    timeout_s: float,
    poll_s: float = 1.0,
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], None] = time.sleep,
) -> DrainReport:
    start = clock()
    marked = False
    try:
        client.set_draining(instance_id, True)
        marked = True
        log.info("instance %s marked draining", instance_id)
    except NotFoundError:
        log.warning("instance %s is not registered; waiting for idle all the same", instance_id)
    except MetaserverClientError as exc:
        log.warning(
            "could not mark %s draining (%s); waiting for idle all the same", instance_id, exc
        )
    idle_polls = 0
    with httpx.Client(timeout=min(5.0, max(poll_s, 1.0))) as http:
        while True:
            elapsed = clock() - start
            try:
                busy = busy_requests(http.get(engine_url.rstrip("/") + "/metrics").text)
            except httpx.HTTPError as exc:
                log.info("engine metrics unreadable (%s): taken as idle", exc)
                busy = 0.0
            idle_polls = idle_polls + 1 if busy == 0 else 0
            if idle_polls >= 2 and elapsed >= settle_s:
                log.info("engine idle after %.1fs; termination goes on", elapsed)
                return DrainReport(marked, True, elapsed)
            if elapsed >= timeout_s:
                log.warning("%.0f request(s) still busy after %.0fs; giving up", busy, elapsed)
                return DrainReport(marked, False, elapsed)
            sleep(poll_s)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python3 -m connector.drain", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    p.add_argument("--metaserver", required=True, metavar="URL")
    p.add_argument("--instance-id", default=os.environ.get("POD_NAME", ""))
    p.add_argument("--engine", default="http://127.0.0.1:8000", metavar="URL")
    p.add_argument("--settle", type=float, default=10.0, help="seconds before idle counts")
    p.add_argument("--timeout", type=float, default=300.0, help="longest wait in all")
    p.add_argument("--poll", type=float, default=1.0, help="seconds between metric reads")
    p.add_argument(
        "--token-file",
        metavar="PATH",
        help=f"the metaserver token, read from this file (default: ${TOKEN_ENV})",
    )
    args = p.parse_args(argv)
    logging.basicConfig(level="INFO", format="%(asctime)s %(name)s: %(message)s", stream=sys.stderr)
    if not args.instance_id:
        p.error("--instance-id (or $POD_NAME) is required")
    token: Token = os.environ.get(TOKEN_ENV) or None
    if args.token_file:
        try:
            token = FileToken(args.token_file)
        except ValueError as exc:
            p.error(f"--token-file: {exc}")
    try:
        client = MetaserverClient(args.metaserver, token=token, retry=RetryPolicy(retries=2))
    except ValueError as exc:  # not an http(s) URL
        p.error(f"--metaserver: {exc}")
    with client:
        drain(
            client, args.instance_id, args.engine,
            settle_s=args.settle, timeout_s=args.timeout, poll_s=args.poll,
        )  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
