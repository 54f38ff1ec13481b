"""Connector settings: ``kv_connector_extra_config`` > ``PDGATE_CONNECTOR_*`` env > YAML > defaults.

Validated once, when vLLM builds the connector, so a typo fails the server at start with a
message naming the key instead of misbehaving at the first request.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Mapping
from typing import Any, Literal

from pydantic import Field, SecretStr, ValidationError, field_validator, model_validator
from pydantic_settings import SettingsConfigDict

from connector.errors import ConfigError
from pdservice.keys import load_keys
from pdservice.settings import LayeredSettings
from pdwire.client.token import FileToken, Token

TOKEN_ENV = "PDGATE_METASERVER_TOKEN"
TEST_HOOKS_ENV = "PDGATE_ALLOW_TEST_HOOKS"  # must be "1" for any test_* key to be on


class ConnectorSettings(LayeredSettings):
    model_config = SettingsConfigDict(env_prefix="PDGATE_CONNECTOR_", extra="forbid")

    metaserver_url: str = Field(
        "", pattern=r"^(https?://[^\s]+)?$", description="metaserver base URL ('' = none)"
    )
    metaserver_token: SecretStr | None = Field(
        None, description=f"bearer token; else metaserver_token_file, else ${TOKEN_ENV}"
    )
    metaserver_token_file: str = Field(
        "",
        description="file holding the bearer token (e.g. a projected Kubernetes ServiceAccount "
        "token), read again whenever it changes; used when metaserver_token is not set",
    )
    instance_id: str = Field("", pattern=r"^[A-Za-z0-9._:-]{0,128}$")
    http_url: str = Field(
        "", description="this vLLM server's own URL, registered in the metaserver"
    )
    side_channel_host: str = Field("", description="address P reaches this instance at")
    side_channel_port: int = Field(5600, ge=1, le=65535 - 1024, description="TP rank r: +r")
    transport: Literal["mooncake", "inprocess"] = "mooncake"
    mooncake_protocol: Literal["tcp", "rdma", "ascend"] = "tcp"
    device_name: str = ""
    device: Literal["cpu", "cuda", "npu"] = "cpu"
    kv_cache_layout: Literal["LBHNC", "LBNHC", "LHBNC", "BLHNC", "BLNHC", "BHLNC", "backend"] = (
        Field(
            "LBHNC",
            description="the KVCacheLayout asked of vLLM (VLLM_KV_CACHE_LAYOUT overrides it): "
            "head-major pages make a TP slice of heads one run per block on both sides; "
            "'backend' leaves the choice to the attention backend",
        )
    )
    kv_load_timeout_s: float = Field(120.0, gt=0, le=86_400)
    heartbeat_s: float = Field(5.0, gt=0, le=3600)
    revision: str = Field(
        "",
        pattern=r"^[A-Za-z0-9._:/+@-]{0,128}$",
        description="this deployment's revision (e.g. the model's version or the image tag): "
        "P and D of different revisions are never paired ('' = none)",
    )
    concurrent: bool = False
    registry_grace_s: float = Field(
        10.0,
        ge=0,
        le=600,
        description="P: how long a binding whose decoder the registry does not vouch for is "
        "re-checked (the request waits, holding no blocks) before P computes it without a push",
    )
    binding_wait_s: float = Field(30.0, gt=0, le=600, description="concurrent mode: long-poll")
    handshake_timeout_s: float = Field(5.0, gt=0, le=600)
    write_timeout_s: int = Field(
        10,
        ge=5,
        le=600,
        description="mooncake: a write with no progress for this long fails (default 30 s); "
        "sets MC_TRANSFER_TIMEOUT and the tcp lanes' deadlines unless the environment has them",
    )
    write_retries: int = Field(
        1,
        ge=0,
        le=5,
        description="P: a failed write is retried this many times before the "
        "transfer fails (the same bytes to the same places, so a retry is harmless)",
    )
    verify_kv: bool = Field(
        False, description="P sends a crc32 per pushed piece, D checks them (host or CUDA memory)"
    )
    keepalive_s: float = Field(
        0.5,
        ge=0,
        le=60,
        description="P: while a push is open, tell D it is alive this often (0: never)",
    )
    side_channel_secret_file: str = Field(
        "",
        description="file holding the side channel's key(s), one per line: the first seals "
        "every P <-> D message, any of them opens one (rotation); every P and D of a "
        "deployment reads the same file; required unless insecure_side_channel",
    )
    insecure_side_channel: bool = Field(
        False,
        description="run the side channel unauthenticated when no side_channel_secret_file is "
        "set: anyone who reaches a D rank's side-channel port can then forge done signals and "
        "read D's KV memory map (a trusted network only; logged as a WARNING at every start)",
    )
    side_channel_max_skew_s: float = Field(
        60.0,
        ge=1,
        le=3600,
        description="a sealed side-channel message sent further than this from the receiver's "
        "clock is refused (the replay window: keep the hosts' clocks in sync)",
    )
    silence_s: float = Field(
        3.0,
        ge=0,
        le=600,
        description="D: a load whose P sent keep-alives and then nothing for this long fails "
        "(recomputed or failed, per kv_load_failure_policy); 0: wait for the deadline",
    )
    landing_wait_s: float = Field(
        10.0,
        ge=0,
        le=600,
        description="D: how long KV whose digests do not match yet may still be landing",
    )
    otlp_traces_endpoint: str = Field(
        "",
        description="send the connector's spans to this OTLP endpoint ('' = "
        "$OTEL_EXPORTER_OTLP_TRACES_ENDPOINT, which vLLM sets from --otlp-traces-endpoint; "
        "neither: no spans); protocol from $OTEL_EXPORTER_OTLP_TRACES_PROTOCOL as for vLLM",
    )
    test_corrupt_push: bool = Field(
        False,
        description="TEST ONLY: P sends garbage for the first block of layer 0 of every "
        f"transfer (negative control of the e2e tests); needs ${TEST_HOOKS_ENV}=1",
    )

    @field_validator("http_url")
    @classmethod
    def _url(cls, v: str) -> str:
        if v and not v.startswith(("http://", "https://")):
            raise ValueError("must start with http:// or https://")
        return v.rstrip("/")

    @field_validator("metaserver_token_file")
    @classmethod
    def _readable_token(cls, v: str) -> str:
        if v:
            FileToken(v)  # a clear error at start, not at the first call
        return v

    @field_validator("side_channel_secret_file")
    @classmethod
    def _readable_secret(cls, v: str) -> str:
        if v:
            load_keys(v)  # a clear error at start, not at the first handshake
        return v

    @model_validator(mode="after")
    def _sealed(self) -> ConnectorSettings:
        if not self.side_channel_secret_file and not self.insecure_side_channel:
            raise ValueError(
                "the P <-> D side channel needs side_channel_secret_file (a file of keys every "
                "P and D of the deployment reads; make one with: umask 077; head -c 32 "
                "/dev/urandom | base64 > FILE); an unauthenticated side channel, on a trusted "
                "network only, takes insecure_side_channel: true"
            )
        return self

    @model_validator(mode="after")
    def _test_hooks(self) -> ConnectorSettings:
        if self.test_corrupt_push and os.environ.get(TEST_HOOKS_ENV) != "1":
            raise ValueError(
                f"test_corrupt_push is a test-only hook that corrupts the KV P pushes; it is "
                f"refused unless the environment has {TEST_HOOKS_ENV}=1"
            )
        return self

    @property
    def token(self) -> Token:
        """What the metaserver clients send: ``metaserver_token``, else the file's token (read
        again when the file changes: each call gives a new reader), else ``$PDGATE_METASERVER_
        TOKEN``."""
        if self.metaserver_token is not None:
            return self.metaserver_token.get_secret_value()
        if self.metaserver_token_file:
            return FileToken(self.metaserver_token_file)
        return os.environ.get(TOKEN_ENV) or None

    def resolved_host(self) -> str:
        return self.side_channel_host or local_ip()

    def resolved_instance_id(self, http_port: int | None = None) -> str:
        if self.instance_id:
            return self.instance_id
        return f"{socket.gethostname()}:{http_port or 8000}"


def local_ip() -> str:
    """This host's outward-facing IP (no packet is sent), loopback when there is no route."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("10.255.255.255", 1))
            return str(s.getsockname()[0])
        except OSError:
            return "127.0.0.1"


def load_settings(extra: Mapping[str, Any] | None) -> ConnectorSettings:
    """Build settings from ``kv_connector_extra_config``; raise ``ConfigError`` naming the key."""
    try:
        return ConnectorSettings(**dict(extra or {}))
    except ValidationError as exc:
        problems = "; ".join(
            f"{'.'.join(str(p) for p in e['loc']) or '<root>'}: {e['msg']}" for e in exc.errors()
        )
        raise ConfigError(
            f"invalid kv_connector_extra_config for PdgateConnector: {problems}"
        ) from None
