"""``pd-metaserver``: run the metaserver (flags > env > --config YAML > defaults)."""

from __future__ import annotations

import argparse
import gc
import logging
import sys
from collections.abc import Sequence
from typing import Any

from pydantic import ValidationError

from metaserver.config import MetaserverSettings
from metaserver.settings import redact_url

DESCRIPTION = """\
pdgate metaserver: records which decode instance (KV endpoint, block ids) each transfer must
be pushed to, plus the registry of live vLLM instances. Stateless over Redis, so run as many
replicas as you like with --store redis://…; the in-memory store suits a single process.
Every option can also come from the environment (PD_METASERVER_<NAME>) or a YAML file (--config).
"""


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="pd-metaserver", description=DESCRIPTION)
    fields = MetaserverSettings.model_fields
    p.add_argument("--config", dest="config_file", help="YAML file with settings")

    def opt(flag: str, name: str, kind: Any = str, **kw: Any) -> None:
        help_text = fields[name].description or ""
        default = fields[name].default
        p.add_argument(
            flag,
            dest=name,
            type=kind,
            default=argparse.SUPPRESS,
            help=f"{help_text} (default: {default})",
            **kw,
        )

    opt("--host", "host")
    opt("--port", "port", int)
    opt("--store", "store")
    opt("--namespace", "namespace")
    opt("--token", "token")
    p.add_argument(
        "--protect-reads",
        dest="protect_reads",
        action="store_true",
        default=argparse.SUPPRESS,
        help="require the token for GET requests too",
    )
    opt("--ttl", "binding_ttl_s", float)
    opt("--retain", "retain_s", float)
    opt("--instance-ttl", "instance_ttl_s", float)
    opt("--max-body-bytes", "max_body_bytes", int)
    opt("--max-wait", "max_wait_s", float)
    opt("--log-level", "log_level")
    return p


def load_settings(argv: Sequence[str] | None = None) -> MetaserverSettings:
    parser = build_parser()
    args = vars(parser.parse_args(argv))
    try:
        return MetaserverSettings(**args)
    except (ValidationError, FileNotFoundError) as exc:
        parser.error(f"invalid settings:\n{exc}")
        raise  # unreachable: parser.error exits


def main(argv: Sequence[str] | None = None) -> None:
    settings = load_settings(argv)
    logging.basicConfig(
        level=settings.log_level.upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    import uvicorn

    from metaserver.app import create_app

    try:
        app = create_app(settings)
    except ValueError as exc:
        build_parser().error(str(exc))
    log = logging.getLogger("pdgate.metaserver")
    log.info(
        "pd-metaserver listening on http://%s:%d (store: %s, writes %s)",
        settings.host,
        settings.port,
        redact_url(settings.store),
        "need a token" if settings.token else "are open (no --token)",
    )
    # Everything built so far (app, models, imported modules) lives as long as the process:
    # keep it out of the collector's full passes, which otherwise show up as p99 latency.
    gc.collect()
    gc.freeze()
    uvicorn.run(
        app,
        host=settings.host,
        port=settings.port,
        loop="uvloop",
        http="httptools",
        log_level=settings.log_level,
        access_log=False,
        timeout_graceful_shutdown=5,
        proxy_headers=False,
        server_header=False,
        date_header=False,
    )


if __name__ == "__main__":
    main()
