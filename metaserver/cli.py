"""``pd-metaserver``: run the metaserver (flags > env > --config YAML > defaults)."""

from __future__ import annotations

import argparse
import gc
import ipaddress
import logging
import sys
from collections.abc import Sequence
from typing import Any

from metaserver.config import MetaserverSettings
from pdservice.settings import SettingsParser, redact_url

DESCRIPTION = """\
pdgate metaserver: records which decode instance (KV endpoint, block ids) each transfer must
be pushed to, plus the registry of live vLLM instances. Stateless over Redis, so run as many
replicas as you like with --store redis://…; the in-memory store suits a single process.
Every option can also come from the environment (PD_METASERVER_<NAME>) or a YAML file (--config).
"""


def build_parser() -> SettingsParser[MetaserverSettings]:
    p = SettingsParser(MetaserverSettings, prog="pd-metaserver", description=DESCRIPTION)
    p.option("--host", "host")
    p.option("--port", "port", int)
    p.option("--store", "store")
    p.option("--namespace", "namespace")
    p.option("--token", "token")
    p.option("--credentials-file", "credentials_file")
    p.switch("--protect-reads", "protect_reads")  # the default; kept for existing command lines
    p.add_argument(
        "--open-reads",
        dest="protect_reads",
        action="store_false",
        default=argparse.SUPPRESS,
        help="INSECURE: anyone may read bindings, instances, load and the KV index",
    )
    p.switch("--insecure-open", "insecure_open")
    p.option("--kube-api", "kube_api_url", metavar="URL")
    p.option("--kube-audience", "kube_audience")
    p.option("--kube-ca-file", "kube_ca_file", metavar="FILE")
    p.option("--kube-token-file", "kube_token_file", metavar="FILE")
    p.option("--ttl", "binding_ttl_s", float)
    p.option("--retain", "retain_s", float)
    p.option("--instance-ttl", "instance_ttl_s", float)
    p.option("--max-instance-ttl", "max_instance_ttl_s", float)
    p.option("--max-body-bytes", "max_body_bytes", int)
    p.option("--max-wait", "max_wait_s", float)
    p.option("--receipt-timeout", "receipt_timeout_s", float)
    p.option("--max-client-connections", "max_client_connections", int)
    p.option("--write-timeout", "write_timeout_s", float)
    p.option("--stats-scan-limit", "stats_scan_limit", int)
    p.option("--metrics-scan-interval", "metrics_scan_interval_s", float)
    p.option("--ttft-target", "ttft_target_p90_s", float)
    p.option("--itl-target", "itl_target_p90_s", float)
    p.option("--advice-window", "advice_window_s", float)
    p.option("--advice-interval", "advice_interval_s", float)
    p.switch("--kv-events", "kv_events")
    p.option("--kv-events-interval", "kv_events_interval_s", float)
    p.option("--kv-placed", "kv_placed_s", float)
    p.option("--log-level", "log_level")
    p.option("--tls-cert", "tls_cert_file")
    p.option("--tls-key", "tls_key_file")
    p.option("--workers", "workers", int)
    p.option("--ascend-decode", "ascend_decode", action="append", metavar="HOST:PORT[-PORT]")
    p.add_argument(
        "--no-ascend-registry",
        dest="ascend_registry",
        action="store_false",
        default=argparse.SUPPRESS,
        help="registered decode instances do not count as the vllm-ascend decode pool",
    )
    p.option("--ascend-refresh", "ascend_refresh_s", float)
    return p


def load_settings(argv: Sequence[str] | None = None) -> MetaserverSettings:
    return build_parser().load(argv)


def main(argv: Sequence[str] | None = None) -> None:
    settings = load_settings(argv)
    _logging(settings)
    import uvicorn

    if open_to_the_network(settings):
        build_parser().error(
            f"refusing to listen on {settings.host} without credentials: give --token or "
            "--credentials-file (docs/security.md), or --insecure-open to let everyone who "
            "reaches it act as admin"
        )
    if settings.workers > 1 and settings.store == "memory":
        build_parser().error(
            "--workers needs a shared store: the memory store lives in one process "
            "(use --store redis://… or redis+sentinel://…)"
        )
    app: Any
    if settings.workers > 1:
        # each worker process builds its own app from the same flags (multiprocessing's
        # spawn hands it this process's argv; the environment is inherited)
        check = _build(settings)  # refuse bad settings here, once, not in every worker
        del check
        app = "metaserver.cli:worker_app"
    else:
        app = _build(settings)
    log = logging.getLogger("pdgate.metaserver")
    mode = "roles" if settings.credentials_file else "single token" if settings.token else "open"
    log.info(
        "pd-metaserver listening on %s://%s:%d (store: %s, access: %s%s, %d process(es))",
        settings.scheme,
        settings.host,
        settings.port,
        redact_url(settings.store),
        mode,
        "" if mode == "open" or settings.protect_reads else ", reads open",
        settings.workers,
    )
    if mode == "open":
        log.warning(
            "INSECURE: no --token or --credentials-file: everyone who reaches %s:%d may read "
            "and write everything, as admin",
            settings.host,
            settings.port,
        )
    uvicorn.run(
        app,
        factory=settings.workers > 1,
        workers=settings.workers if settings.workers > 1 else None,
        host=settings.host,
        port=settings.port,
        loop="uvloop",
        http="metaserver.listener:GuardedHttpToolsProtocol",
        log_level=settings.log_level,
        access_log=False,
        timeout_graceful_shutdown=5,
        proxy_headers=False,
        server_header=False,
        date_header=False,
        # a worker busy importing or starting on a loaded machine is not a dead one
        timeout_worker_healthcheck=30,
        **settings.uvicorn_tls(),
    )


def open_to_the_network(settings: MetaserverSettings) -> bool:
    """Whether these settings would serve everyone as admin on a non-loopback address, not
    asked for by name (``--insecure-open``)."""
    if settings.token or settings.credentials_file or settings.insecure_open:
        return False
    return not loopback(settings.host)


def loopback(host: str) -> bool:
    """A literal loopback address or ``localhost`` (a name that may resolve elsewhere is not)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def _logging(settings: MetaserverSettings) -> None:
    logging.basicConfig(
        level=settings.log_level.upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )


def _build(settings: MetaserverSettings) -> Any:
    from metaserver.app import create_app

    app: Any
    try:
        app = create_app(settings)
    except ValueError as exc:
        build_parser().error(str(exc))
    # read by the listener's guards (pdservice.listener): a whole request within the
    # deadline (no handler here reads a body as it streams)
    app.receipt_timeout_s = settings.receipt_timeout_s
    app.receipt_whole_request = True
    app.max_client_connections = settings.max_client_connections
    app.write_timeout_s = settings.write_timeout_s
    # Everything built so far (app, models, imported modules) lives as long as the process:
    # keep it out of the collector's full passes, which otherwise show up as p99 latency.
    gc.collect()
    gc.freeze()
    return app


def worker_app() -> Any:
    """One worker process's app (``--workers``), from the flags the parent was started with."""
    settings = load_settings(sys.argv[1:])
    _logging(settings)
    return _build(settings)


if __name__ == "__main__":
    main()
