#!/usr/bin/env python3
"""Docker HEALTHCHECK of the pdgate image: GET /health of whichever program the container runs.

The URL is $PDGATE_HEALTH_URL when set. Otherwise it is derived from the container's main process
(PID 1, or --pid): pd-proxy listens on --port / $PD_PROXY_PORT / 8000, pd-metaserver on --port /
$PD_METASERVER_PORT / 8300. Exit status 0 means healthy, 1 unhealthy (Docker's convention).
Standard library only: it runs with the image's Python and nothing else.
"""

from __future__ import annotations

import argparse
import os
import sys
import urllib.error
import urllib.request
from collections.abc import Mapping, Sequence

PROGRAMS = {
    # program name: (environment variable of its port, default port)
    "pd-proxy": ("PD_PROXY_PORT", 8000),
    "pd-metaserver": ("PD_METASERVER_PORT", 8300),
}


def _flag(argv: Sequence[str], name: str) -> str | None:
    value: str | None = None
    for i, arg in enumerate(argv):
        if arg == name and i + 1 < len(argv):
            value = argv[i + 1]
        elif arg.startswith(name + "="):
            value = arg.split("=", 1)[1]
    return value  # the last occurrence wins, as with argparse


def health_url(cmdline: Sequence[str], env: Mapping[str, str]) -> str:
    """The /health URL of the pdgate program in ``cmdline`` (a process's argv)."""
    if env.get("PDGATE_HEALTH_URL"):
        return env["PDGATE_HEALTH_URL"]
    for arg in cmdline:
        name = os.path.basename(arg)
        if name in PROGRAMS:
            port_env, default = PROGRAMS[name]
            port = _flag(cmdline, "--port") or env.get(port_env) or str(default)
            return f"http://127.0.0.1:{int(port)}/health"
    raise LookupError(f"no pdgate program in {list(cmdline)!r}; set PDGATE_HEALTH_URL")


def read_cmdline(pid: int) -> list[str]:
    with open(f"/proc/{pid}/cmdline", "rb") as f:
        return [a.decode(errors="replace") for a in f.read().split(b"\0") if a]


def check(url: str, timeout: float) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:
            return 200 <= int(resp.status) < 300
    except (urllib.error.URLError, OSError, ValueError):
        return False


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="pdgate-healthcheck", description=__doc__)
    parser.add_argument("--pid", type=int, default=1, help="process to inspect (default 1)")
    parser.add_argument("--timeout", type=float, default=4.0, help="seconds (default 4)")
    args = parser.parse_args(argv)
    try:
        url = health_url(read_cmdline(args.pid), os.environ)
    except (LookupError, OSError) as exc:
        print(f"pdgate-healthcheck: {exc}", file=sys.stderr)
        return 1
    healthy = check(url, args.timeout)
    print(f"{url}: {'healthy' if healthy else 'unhealthy'}")
    return 0 if healthy else 1


if __name__ == "__main__":
    sys.exit(main())
