"""``pd-proxy``: run the proxy (flags > env ``PD_PROXY_*`` > --config YAML > defaults)."""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from collections.abc import Sequence
from typing import Any

from pdservice.settings import SettingsParser
from proxy.config import Flow, ProxySettings
from proxy.policies import POLICIES

DESCRIPTION = """\
pdgate proxy: an OpenAI-compatible router that pairs a prefill (P) and a decode (D) vLLM
instance per request.

Flows (--flow):
  decode-first   D first: D gets the request with kv_transfer_params {do_remote_prefill,
                 transfer_id}, allocates blocks and writes a binding to the metaserver; the
                 proxy waits for it, then sends P a max_tokens=1 request carrying the binding;
                 P pushes KV into D's blocks layer by layer. Needs --metaserver.
  concurrent     like decode-first, but P is sent at once and fetches the binding itself.
  prefill-first  P first (pull connectors: vLLM's NixlConnector): P's kv_transfer_params
                 are handed to D unchanged.
  direct         no disaggregation: D computes the prompt.
  ascend-layerwise  decode-first for unchanged vllm-ascend engines (MooncakeLayerwiseConnector):
                 D gets {do_remote_prefill, metaserver: <URL>} and posts its blocks to the
                 metaserver's /v1/ascend/metaserver; the proxy waits for them, then sends P
                 the prefill with D's parameters. Needs --metaserver (and the metaserver's
                 --ascend-decode pool); --ascend-callback-url if D reaches it elsewhere.
Prompts estimated below --disagg-min-tokens skip P whatever the flow.

Instances come from --prefill/--decode (static), the metaserver registry (--discovery
metaserver) or Kubernetes headless Services (--discovery dns --prefill-dns NAME:PORT ...).
Every option can also come from the environment (PD_PROXY_<NAME>) or a YAML file (--config).
"""

# --workers: the command line each worker loads its settings from, as the parent did (secrets
# come from the environment, which workers inherit: nothing the parent revealed is written)
_ARGV_ENV = "PDGATE_PROXY_WORKER_ARGV"


def build_parser() -> SettingsParser[ProxySettings]:
    p = SettingsParser(
        ProxySettings,
        prog="pd-proxy",
        description=DESCRIPTION,
        formatter_class=argparse.RawTextHelpFormatter,
    )
    opt = p.option
    opt("--host", "host")
    opt("--port", "port", int)
    opt("--workers", "workers", int)
    opt("--log-level", "log_level")
    opt("--prefill", "prefill", action="append", metavar="URL")
    opt("--decode", "decode", action="append", metavar="URL")
    opt("--discovery", "discovery", choices=["static", "metaserver", "dns"])
    opt("--prefill-dns", "prefill_dns", metavar="NAME:PORT")
    opt("--decode-dns", "decode_dns", metavar="NAME:PORT")
    opt("--discovery-interval", "discovery_interval_s", float)
    opt("--metaserver", "metaserver", metavar="URL")
    opt("--metaserver-token", "metaserver_token")
    opt("--flow", "flow", choices=[f.value for f in Flow])
    opt("--ascend-callback-url", "ascend_callback_url", metavar="URL")
    p.switch("--flow-header", "flow_header")
    p.switch("--binding-marks", "binding_marks")
    p.unswitch("--no-binding-feed", "binding_feed")
    p.unswitch("--no-first-token-check", "first_token_check")
    p.unswitch("--no-early-first-token", "early_first_token")
    opt("--pair-quarantine", "pair_quarantine_s", float)
    opt("--canary-interval", "canary_interval_s", float)
    opt("--disagg-min-tokens", "disagg_min_tokens", int)
    opt("--cached-skip-ratio", "cached_skip_ratio", float)
    policies = sorted(POLICIES)
    opt("--prefill-policy", "prefill_policy", choices=policies)
    opt("--decode-policy", "decode_policy", choices=policies)
    opt("--tokenizer", "tokenizer")
    opt("--kv-hash-seed", "kv_hash_seed")
    p.switch("--share-load", "share_load")
    opt("--replica-id", "replica_id")
    opt("--share-interval", "share_interval_s", float)
    opt("--api-key", "api_keys", action="append", metavar="KEY")
    opt("--admin-key", "admin_keys", action="append", metavar="KEY")
    opt("--engine-api-key-file", "engine_api_key_file", metavar="FILE")
    opt("--retries", "retries", int)
    opt("--backoff-base", "backoff_base_s", float)
    opt("--backoff-cap", "backoff_cap_s", float)
    opt("--connect-timeout", "connect_timeout_s", float)
    opt("--prefill-timeout", "prefill_timeout_s", float)
    opt("--binding-wait", "binding_wait_s", float)
    opt("--prefill-grace", "prefill_grace_s", float)
    opt("--first-token-timeout", "first_token_timeout_s", float)
    opt("--idle-timeout", "idle_timeout_s", float)
    opt("--migration-limit", "migration_limit", int)
    opt("--request-timeout", "request_timeout_s", float)
    opt("--health-interval", "health_interval_s", float)
    opt("--circuit-failures", "circuit_failures", int)
    opt("--circuit-open", "circuit_open_s", float)
    opt("--max-inflight", "max_inflight", int)
    opt("--max-body-bytes", "max_body_bytes", int)
    opt("--receipt-timeout", "receipt_timeout_s", float)
    opt("--max-client-connections", "max_client_connections", int)
    opt("--write-timeout", "write_timeout_s", float)
    opt("--max-choices", "max_choices", int)
    opt("--max-connections", "max_connections", int)
    opt("--http-client", "http_client", choices=["native", "aiohttp"])
    opt("--keepalive", "keepalive_s", float)
    opt("--client-keepalive", "client_keepalive_s", float)
    opt("--tls-cert", "tls_cert_file")
    opt("--tls-key", "tls_key_file")
    opt("--otlp-traces-endpoint", "otlp_traces_endpoint", metavar="URL")
    return p


def load_settings(argv: Sequence[str] | None = None) -> ProxySettings:
    return build_parser().load(argv)


def app_from_env() -> Any:
    """Factory for ``--workers`` > 1: each worker loads the parent's command line again."""
    from proxy.app import create_app

    return create_app(load_settings(json.loads(os.environ[_ARGV_ENV])))


def main(argv: Sequence[str] | None = None) -> None:
    args = list(sys.argv[1:] if argv is None else argv)
    settings = load_settings(args)
    logging.basicConfig(
        level=settings.log_level.upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    import uvicorn

    from proxy.app import create_app

    log = logging.getLogger("pdgate.proxy")
    log.info(
        "pd-proxy on %s://%s:%d: flow %s, discovery %s, policies P=%s D=%s, %d worker(s)",
        settings.scheme,
        settings.host,
        settings.port,
        settings.flow.value,
        settings.discovery.value,
        settings.prefill_policy,
        settings.decode_policy,
        settings.workers,
    )
    common: dict[str, Any] = {
        "host": settings.host,
        "port": settings.port,
        "loop": "uvloop",
        "http": "proxy.server:CoalescingHttpToolsProtocol",
        "log_level": settings.log_level,
        "access_log": False,
        "timeout_graceful_shutdown": 30,
        "timeout_keep_alive": settings.client_keepalive_s,
        **settings.uvicorn_tls(),
        "backlog": 4096,
        "proxy_headers": False,
        "server_header": False,
    }
    if settings.workers > 1:
        os.environ[_ARGV_ENV] = json.dumps(args)  # what ps already shows of this process
        uvicorn.run("proxy.cli:app_from_env", factory=True, workers=settings.workers, **common)
    else:
        uvicorn.run(create_app(settings), **common)


if __name__ == "__main__":
    main()
