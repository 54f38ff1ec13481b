"""Proxy settings (``PD_PROXY_*`` environment variables, YAML file via --config, CLI flags)."""

from __future__ import annotations

import enum
import re
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any

from pydantic import Field, SecretStr, field_validator, model_validator
from pydantic_settings import NoDecode, SettingsConfigDict

from pdservice.settings import LayeredSettings, redact_url
from pdservice.tls import TlsListener

_VISIBLE_ASCII = re.compile(r"[\x21-\x7e]+")


class Flow(enum.StrEnum):
    DECODE_FIRST = "decode-first"
    CONCURRENT = "concurrent"
    PREFILL_FIRST = "prefill-first"
    DIRECT = "direct"
    ASCEND_LAYERWISE = "ascend-layerwise"


_NEEDS_METASERVER = (Flow.DECODE_FIRST, Flow.CONCURRENT, Flow.ASCEND_LAYERWISE)


class HttpClient(enum.StrEnum):
    NATIVE = "native"
    AIOHTTP = "aiohttp"


class Discovery(enum.StrEnum):
    STATIC = "static"
    METASERVER = "metaserver"
    DNS = "dns"


def _split(value: Any) -> Any:
    if isinstance(value, str):
        return [v.strip() for v in value.split(",") if v.strip()]
    return value


UrlList = Annotated[list[str], NoDecode]
KeyList = Annotated[list[SecretStr], NoDecode]


class ProxySettings(LayeredSettings, TlsListener):
    model_config = SettingsConfigDict(env_prefix="PD_PROXY_", extra="forbid")

    host: str = Field("127.0.0.1", description="address to listen on")
    port: int = Field(8000, ge=0, le=65535)
    workers: int = Field(1, ge=1, le=64, description="server processes (load state per process)")
    log_level: str = Field("info", pattern=r"^(debug|info|warning|error)$")

    # instances
    discovery: Discovery = Field(Discovery.STATIC, description="where instances come from")
    prefill: UrlList = Field(default_factory=list, description="prefill instance URLs")
    decode: UrlList = Field(default_factory=list, description="decode instance URLs")
    prefill_dns: str | None = Field(None, description="NAME:PORT of the prefill headless Service")
    decode_dns: str | None = Field(None, description="NAME:PORT of the decode headless Service")
    discovery_interval_s: float = Field(5.0, gt=0, description="re-resolve / re-read period")

    # metaserver
    metaserver: str | None = Field(None, description="metaserver URL (decode-first flows)")
    metaserver_token: SecretStr | None = Field(None, description="metaserver bearer token")
    ascend_callback_url: str | None = Field(
        None,
        description="ascend-layerwise: the URL vllm-ascend D engines POST their blocks to "
        "(default: --metaserver + /v1/ascend/metaserver; with --metaserver-token, each "
        "request's URL carries a capability for that request alone, never the token)",
        pattern=r"^https?://[^\s?#]+$",
    )

    # flows
    flow: Flow = Field(Flow.DECODE_FIRST, description="P/D flow")
    flow_header: bool = Field(False, description="honour a per-request x-pd-flow header")
    binding_marks: bool = Field(
        False, description="post first_token / end marks to each decode-first binding"
    )
    binding_feed: bool = Field(
        True,
        description="decode-first reads D's bindings from one feed the metaserver streams "
        "to this process (long-polls while it is down)",
    )
    disagg_min_tokens: int = Field(
        0, ge=0, description="prompts estimated below this many tokens skip P (0: never)"
    )
    first_token_check: bool = Field(
        True,
        description="on greedy requests compare P's first token with D's before D's answer "
        "goes out; a mismatch quarantines the pair and D computes the prompt itself",
    )
    early_first_token: bool = Field(
        True,
        description="decode-first and concurrent: a streamed greedy request's first token goes "
        "to the client from P's answer, without waiting for D's (proxy.early)",
    )
    canary_interval_s: float = Field(
        0.0,
        ge=0,
        description="send a greedy one-token canary through each P/D pair that no greedy "
        "request judged for this many seconds (0: no canaries)",
    )
    pair_quarantine_s: float = Field(
        300.0, gt=0, description="how long a pair whose first tokens differed is not paired"
    )
    cached_skip_ratio: float = Field(
        0.0, ge=0, le=1, description="skip P when D likely caches this share of the prompt (0: off)"
    )

    # selection
    prefill_policy: str = Field("least_load", description="prefill selection policy")
    decode_policy: str = Field("least_load", description="decode selection policy")
    tokenizer: str | None = Field(
        None,
        description="the served model's tokenizer (a local directory): the kv policy tokenizes "
        "prompts with it and its chat template, as the engines do",
    )
    share_load: bool = Field(
        False,
        description="active-active replicas: share in-flight load and open circuits with the "
        "other proxy replicas through the metaserver",
    )
    replica_id: str | None = Field(
        None,
        pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]{0,100}$",
        description="this replica's name in the shared load (default: host name and pid); "
        "with --workers each process adds its pid",
    )
    share_interval_s: float = Field(
        0.1,
        gt=0,
        le=10,
        description="how often the load is reported when no choice reports it sooner "
        "(each choice reads the others' load first; each change is reported at once; reports "
        "lapse after 3x)",
    )
    kv_hash_seed: str = Field(
        "vllm-none-hash",
        description="the engines' PYTHONHASHSEED when they set one (vLLM's default seed if not)",
    )

    # resilience
    retries: int = Field(2, ge=0, le=10, description="extra attempts before the first byte")
    backoff_base_s: float = Field(0.02, ge=0, description="first retry waits up to this")
    backoff_cap_s: float = Field(1.0, ge=0, description="longest wait between retries")
    connect_timeout_s: float = Field(3.0, gt=0, description="TCP connect to a backend")
    prefill_timeout_s: float = Field(300.0, gt=0, description="the whole prefill leg")
    binding_wait_s: float = Field(30.0, gt=0, description="D writing its binding")
    prefill_grace_s: float = Field(
        0.5,
        ge=0,
        description="decode-first: once D streams, how long P's answer is still awaited "
        "(its push report and cached tokens) before P's leg is dropped",
    )
    first_token_timeout_s: float = Field(300.0, gt=0, description="D's first streamed byte")
    request_timeout_s: float = Field(600.0, gt=0, description="whole non-streaming answer")
    idle_timeout_s: float = Field(120.0, gt=0, description="longest gap between streamed chunks")
    migration_limit: int = Field(
        1,
        ge=0,
        le=10,
        description="times a streamed answer goes on from another pair when D breaks after its "
        "first byte (0: off; the client gets an error event)",
    )
    health_interval_s: float = Field(5.0, gt=0, description="active probe period (GET /health)")
    circuit_failures: int = Field(5, ge=1, description="consecutive failures that open a circuit")
    circuit_open_s: float = Field(10.0, gt=0, description="how long an open circuit rejects")
    max_inflight: int = Field(4096, ge=1, description="admission limit; above it: 429")
    max_body_bytes: int = Field(16 << 20, ge=1024, description="request bodies above it: 413")
    receipt_timeout_s: float = Field(
        30.0,
        gt=0,
        description="a request's head must arrive within this many seconds of its first byte "
        "(else the connection is closed), and its body within as many after the head (else 408)",
    )
    write_timeout_s: float = Field(
        60.0,
        ge=0,
        description="a client that reads nothing of its answer for this long while the "
        "connection's send buffer is full is cut off, its legs aborted (0: never)",
    )
    max_client_connections: int = Field(
        0,
        ge=0,
        description="connections one client address may hold; its next ones are closed at once "
        "(0: no cap; behind a load balancer every client has the balancer's address)",
    )
    max_choices: int = Field(
        16,
        ge=1,
        le=1024,
        description="'n' or 'best_of' above it: 400 (each choice is a sequence D decodes)",
    )
    max_connections: int = Field(1024, ge=1, description="pooled connections to backends")
    http_client: HttpClient = Field(
        HttpClient.NATIVE, description="data-path HTTP client: native (httptools) or aiohttp"
    )
    keepalive_s: float = Field(
        4.0, gt=0, description="reuse an idle backend connection at most this long"
    )
    client_keepalive_s: float = Field(
        75.0,
        gt=0,
        description="keep an idle client connection open this long; longer than clients keep "
        "theirs (httpx and the openai client: 5 s), so a client never sends a request on a "
        "connection the proxy is closing",
    )

    # observability
    otlp_traces_endpoint: str | None = Field(
        None,
        description="send OpenTelemetry traces (OTLP/HTTP protobuf) to this URL, e.g. "
        "http://collector:4318/v1/traces; unset: $OTEL_EXPORTER_OTLP_TRACES_ENDPOINT, and "
        "tracing is off when neither is set",
    )

    # inbound auth
    api_keys: KeyList = Field(default_factory=list, description="accepted bearer keys")
    admin_keys: KeyList = Field(
        default_factory=list,
        description="bearer keys of the /admin endpoints (empty: /admin is off); each must "
        "differ from every --api-key",
    )

    # outbound auth: what the engines' own --api-key asks of every call (only the proxy holds it)
    engine_api_key: SecretStr | None = Field(
        None,
        description="sent as a bearer token on every request to an engine (vLLM's --api-key / "
        "VLLM_API_KEY on the engines); prefer the environment or --engine-api-key-file",
    )
    engine_api_key_file: Path | None = Field(
        None, description="read the engines' API key from this file (its first line)"
    )

    @field_validator("prefill", "decode", "api_keys", "admin_keys", mode="before")
    @classmethod
    def _comma_lists(cls, value: Any) -> Any:
        return _split(value)

    @field_validator("prefill", "decode")
    @classmethod
    def _urls(cls, value: list[str]) -> list[str]:
        for url in value:
            if not url.startswith(("http://", "https://")):
                raise ValueError(f"{url!r} is not an http(s) URL")
        return [u.rstrip("/") for u in value]

    @model_validator(mode="after")
    def _engine_key(self) -> ProxySettings:
        if self.engine_api_key_file is None:
            return self
        if self.engine_api_key is not None:
            raise ValueError("give the engines' API key once: engine_api_key or its file")
        try:
            line = self.engine_api_key_file.read_text().splitlines()[0].strip()
        except (OSError, IndexError) as exc:
            raise ValueError(f"engine API key file {self.engine_api_key_file}: {exc}") from None
        if not line:
            raise ValueError(f"engine API key file {self.engine_api_key_file} is empty")
        self.engine_api_key = SecretStr(line)
        self.engine_api_key_file = None  # the key is in hand: a worker rebuilds from it
        return self

    @model_validator(mode="after")
    def _engine_key_printable(self) -> ProxySettings:
        """The key goes into a header line as it is: visible ASCII only (no space, no control
        character), or one key could add headers of its own to every leg."""
        key = self.engine_api_key
        if key is not None and not _VISIBLE_ASCII.fullmatch(key.get_secret_value()):
            raise ValueError("the engines' API key must be visible ASCII characters, no spaces")
        return self

    @property
    def engine_authorization(self) -> str | None:
        """The Authorization header every engine call carries (``None``: no key)."""
        key = self.engine_api_key
        return None if key is None else f"Bearer {key.get_secret_value()}"

    @model_validator(mode="after")
    def _consistent(self) -> ProxySettings:
        shared = {k.get_secret_value() for k in self.api_keys} & {
            k.get_secret_value() for k in self.admin_keys
        }
        if shared:
            raise ValueError("an --admin-key must differ from every --api-key")
        needs_p = self.flow != Flow.DIRECT
        if self.discovery == Discovery.STATIC:
            if not self.decode:
                raise ValueError("static discovery needs at least one --decode URL")
            if needs_p and not self.prefill:
                raise ValueError(f"flow {self.flow} needs at least one --prefill URL")
        if self.discovery == Discovery.DNS and not (self.decode_dns and self.prefill_dns):
            raise ValueError("dns discovery needs --prefill-dns and --decode-dns NAME:PORT")
        if self.discovery == Discovery.METASERVER and not self.metaserver:
            raise ValueError("metaserver discovery needs --metaserver")
        if self.flow in _NEEDS_METASERVER and not self.metaserver:
            raise ValueError(f"flow {self.flow} needs --metaserver")
        if "kv" in (self.prefill_policy, self.decode_policy) and not (
            self.metaserver and self.tokenizer
        ):
            raise ValueError(
                "the kv policy needs --metaserver (its KV-event index) and --tokenizer"
            )
        return self

    @property
    def kv_routing(self) -> bool:
        return "kv" in (self.prefill_policy, self.decode_policy)

    def ascend_urls(self) -> Callable[[str], str]:
        """``X-Request-Id`` → where vllm-ascend D engines POST that request's blocks (the
        metaserver's compat endpoint; with a token, a per-request capability in the query)."""
        from pdwire.ascend import COMPAT_PATH, callback_urls

        assert self.metaserver is not None
        url = self.ascend_callback_url or self.metaserver.rstrip("/") + COMPAT_PATH
        token = self.metaserver_token
        return callback_urls(url, None if token is None else token.get_secret_value())

    def __repr_args__(self) -> Any:
        for key, value in super().__repr_args__():
            yield key, (redact_url(value) if key == "metaserver" and value else value)
