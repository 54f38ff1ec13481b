"""Metaserver settings (``PD_METASERVER_*`` environment variables, YAML file, CLI flags)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

from pydantic import Field, SecretStr, field_validator
from pydantic_settings import NoDecode, SettingsConfigDict

from metaserver.access.kube import IN_CLUSTER, KubeReviewer, in_cluster_url
from metaserver.ascend.pool import PoolEntry
from metaserver.kvindex.index import PLACED_S
from pdservice.settings import LayeredSettings, redact_url
from pdservice.tls import TlsListener


class MetaserverSettings(LayeredSettings, TlsListener):
    model_config = SettingsConfigDict(env_prefix="PD_METASERVER_", extra="forbid")

    host: str = Field("127.0.0.1", description="address to listen on")
    port: int = Field(8300, ge=0, le=65535)
    store: str = Field(
        "memory", description="'memory', a redis:// URL, or redis+sentinel://host:port,.../service"
    )
    namespace: str = Field(
        "pdgate", pattern=r"^[A-Za-z0-9_.-]{1,64}$", description="Redis key prefix"
    )
    token: SecretStr | None = Field(
        None, description="single-token mode: this bearer token may do everything"
    )
    credentials_file: Path | None = Field(
        None,
        description="roles mode: a YAML file of bearer tokens with roles (admin, proxy, engine "
        "bound to instance ids, reader); see docs/security.md",
    )
    kube_api_url: str = Field(
        "",
        description="the Kubernetes API that reviews engine pods' tokens (kubernetes: "
        "credentials); '' = in-cluster (KUBERNETES_SERVICE_HOST)",
    )
    kube_audience: str = Field(
        "pdgate-metaserver", min_length=1, description="the audience pods' projected tokens carry"
    )
    kube_ca_file: Path | None = Field(
        None, description="CA of the Kubernetes API (default: the in-cluster one)"
    )
    kube_token_file: Path | None = Field(
        None,
        description="the metaserver's own token for the Kubernetes API (default: the "
        "in-cluster one; re-read at each call, as the kubelet rotates it)",
    )
    protect_reads: bool = Field(
        True,
        description="reads need a credential too (/health, /ready, /metrics and the page's "
        "files stay open)",
    )
    insecure_open: bool = Field(
        False,
        description="INSECURE: without --token or --credentials-file, listen on a non-loopback "
        "address anyway (everyone who reaches it is admin)",
    )
    binding_ttl_s: float = Field(600.0, gt=0, description="lifetime of an unfinished binding")
    retain_s: float = Field(900.0, gt=0, description="how long done/failed/aborted bindings stay")
    instance_ttl_s: float = Field(30.0, gt=0, description="default heartbeat TTL of instances")
    max_instance_ttl_s: float = Field(
        300.0, gt=0, le=86_400, description="a registration asking a longer ttl_s gets 422"
    )
    max_body_bytes: int = Field(1 << 20, ge=1024, description="request bodies above this get 413")
    receipt_timeout_s: float = Field(
        30.0,
        gt=0,
        description="a request (head and body) must arrive within this many seconds of its "
        "first byte, else the connection is closed",
    )
    write_timeout_s: float = Field(
        60.0,
        ge=0,
        description="a client that reads nothing of its answer for this long while the "
        "connection's send buffer is full is cut off (0: never)",
    )
    max_client_connections: int = Field(
        0,
        ge=0,
        description="connections one client address may hold; its next ones are closed at once "
        "(0: no cap)",
    )
    max_wait_s: float = Field(120.0, gt=0, le=3600, description="cap of ?wait= on long-polls")
    metrics_scan_interval_s: float = Field(
        5.0,
        ge=0,
        le=300,
        description="/metrics (open to scrapers) scans the newest bindings for the in-flight "
        "gauges at most this often",
    )
    stats_scan_limit: int = Field(
        10_000, ge=1, description="bindings scanned by /v1/stats and /v1/breakdown"
    )
    ttft_target_p90_s: float | None = Field(
        None,
        gt=0,
        description="p90 TTFT target: keeps the pool_recommended gauges current (P:D advice)",
    )
    itl_target_p90_s: float | None = Field(
        None,
        gt=0,
        description="p90 inter-token latency target: with or without the TTFT target, keeps the "
        "pool_recommended gauges current (P:D advice)",
    )
    advice_window_s: float = Field(300.0, gt=0, le=86_400, description="advice's window")
    advice_interval_s: float = Field(15.0, gt=0, description="how often the gauges are refreshed")
    kv_events: bool = Field(
        False,
        description="follow registered engines' KV cache events into the prefix-cache index "
        "(POST /v1/kv/match); with replicas on one Redis, one follows at a time",
    )
    kv_events_interval_s: float = Field(
        2.0, gt=0, le=60, description="how often the registry is read for engines to follow"
    )
    kv_placed_s: float = Field(
        PLACED_S,
        gt=0,
        le=600,
        description="a proxy's placement (POST /v1/kv/placed) counts as held this long, until "
        "the engine's own events say so",
    )
    log_level: str = Field("info", pattern=r"^(debug|info|warning|error)$")
    workers: int = Field(
        1, ge=1, le=64, description="server processes on the port (more than 1 needs Redis)"
    )

    # vllm-ascend compatibility (POST /v1/ascend/metaserver)
    ascend_decode: Annotated[list[str], NoDecode] = Field(
        default_factory=list,
        description="decode pool for vllm-ascend bindings: HOST:PORT[-PORT] (HOST an address "
        "or a DNS name, e.g. the decode headless Service), comma-separated",
    )
    ascend_registry: bool = Field(
        True, description="registered decode instances' KV endpoints also count as the pool"
    )
    ascend_refresh_s: float = Field(5.0, gt=0, description="re-resolve / re-read the pool")

    @field_validator("ascend_decode", mode="before")
    @classmethod
    def _comma_list(cls, value: Any) -> Any:
        items = [value] if isinstance(value, str) else value
        if isinstance(items, list):  # each flag or env entry may hold several, comma-separated
            return [v.strip() for item in items for v in str(item).split(",") if v.strip()]
        return value

    @field_validator("ascend_decode")
    @classmethod
    def _pool_entries(cls, value: list[str]) -> list[str]:
        for entry in value:
            PoolEntry.parse(entry)
        return value

    def kube_reviewer(self) -> KubeReviewer:
        """The reviewer of pods' tokens these settings name (in-cluster defaults)."""
        url = self.kube_api_url or in_cluster_url()
        if not url:
            raise ValueError(
                "kubernetes credentials need the Kubernetes API: run in a cluster or give "
                "--kube-api"
            )
        ca = self.kube_ca_file or (IN_CLUSTER / "ca.crt" if not self.kube_api_url else None)
        token = self.kube_token_file or (IN_CLUSTER / "token" if not self.kube_api_url else None)
        return KubeReviewer(url, audience=self.kube_audience, ca_file=ca, token_file=token)

    def __repr_args__(self) -> Any:
        for key, value in super().__repr_args__():
            yield key, (redact_url(value) if key == "store" else value)
