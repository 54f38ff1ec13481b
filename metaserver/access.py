"""Who may call what on the metaserver.

Three modes, from the settings:

- **open** (no ``--token``, no ``--credentials-file``): every call is allowed. One machine,
  development: ``pd-metaserver`` refuses it on a non-loopback address unless
  ``--insecure-open``.
- **single token** (``--token``): that one bearer token may do everything. For small setups whose
  parts are all trusted alike: every engine pod then holds a token that can drain the fleet.
- **roles** (``--credentials-file``): each bearer token in the file has one role:

  ========  ================================================================================
  admin     everything
  proxy     reads; binding marks (no events); drain and undrain
  engine    reads; register, heartbeat, drain and deregister the instances it is bound to
            (``instance``: one id, or a prefix ending in ``*`` for a pool whose ids are made
            at start, such as pod names; at most ``max_instances`` live, on ``hosts``); write
            bindings that name such an instance as their decode; post the events that are
            such an instance's steps; ``engine_role`` limits what it registers
  reader    reads (the timeline page, dashboards)
  ========  ================================================================================

Reads need a credential too unless ``--open-reads`` (open mode aside). A call without a known
token is 401; a known token whose role does not allow the call is 403, naming the role.

Tokens are found by their SHA-256 (a dict lookup, not a comparison that leaks their bytes by
timing). The proxy's and admin's tokens also key the per-request capabilities that vllm-ascend
D engines present (``pdwire.ascend.capability``), so no deployment token travels in a request.
"""

from __future__ import annotations

import enum
import hashlib
import hmac
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from metaserver.errors import Forbidden, Unauthorized
from metaserver.hosts import Hosts
from pdwire.ascend import capability as make_capability
from pdwire.ids import ID_BODY
from pdwire.models import InstanceRole, InstanceSpec
from pdwire.origin import parse_origin

MIN_TOKEN_CHARS = 16
EXACT_CAP = 1  # registrations an engine credential bound to one id may hold
POOL_CAP = 64  # ... and one bound to a prefix (a pool's pods)


class Role(enum.StrEnum):
    ADMIN = "admin"
    PROXY = "proxy"
    ENGINE = "engine"
    READER = "reader"


@dataclass(frozen=True, slots=True)
class Principal:
    """Whoever made a call: its credential's name and role (engines: the ids it may act as,
    the hosts it may register, how many instances it may hold)."""

    name: str
    role: Role
    instance: str | None = None  # engines: an id, or a prefix ending in "*"
    engine_role: InstanceRole | None = None
    hosts: Hosts | None = None  # engines: where its URL and KV endpoint may point (None: any)
    max_instances: int = 0  # engines: live registrations it may hold (0: no cap)

    @property
    def owner(self) -> str:
        """The name its registrations are counted under ('' : not counted)."""
        return self.name if self.role is Role.ENGINE else ""

    def covers(self, instance_id: str) -> bool:
        if self.instance is None:
            return False
        if self.instance.endswith("*"):
            return instance_id.startswith(self.instance[:-1])
        return instance_id == self.instance

    def _refuse(self, what: str) -> Forbidden:
        return Forbidden(f"credential {self.name!r} (role {self.role.value}) may not {what}")

    def may_register(self, instance_id: str, spec: InstanceSpec) -> None:
        """PUT an instance (register or heartbeat): an id it covers, its role, hosts it may
        name."""
        self.may_manage(instance_id)
        if self.engine_role is not None and spec.role is not self.engine_role:
            raise self._refuse(f"register a {spec.role.value} instance")
        if self.hosts is None:
            return
        hosts = [parse_origin(spec.url).host]
        if spec.kv_endpoint is not None:
            hosts.append(spec.kv_endpoint.host)
        for host in hosts:
            if not self.hosts.allows(host):
                raise self._refuse(f"register an instance on host {host!r}")

    def may_manage(self, instance_id: str) -> None:
        """Deregister an instance (and what registering needs)."""
        if self.role is Role.ADMIN or (self.role is Role.ENGINE and self.covers(instance_id)):
            return
        raise self._refuse(f"act as instance {instance_id!r}")

    def may_drain(self, instance_id: str) -> None:
        if self.role is Role.PROXY:
            return
        self.may_manage(instance_id)

    def may_bind(self, decode_instance_id: str) -> None:
        """Write a binding naming ``decode_instance_id`` as the decode."""
        if self.role is Role.ADMIN or (
            self.role is Role.ENGINE and self.covers(decode_instance_id)
        ):
            return
        raise self._refuse(f"write a binding for decode instance {decode_instance_id!r}")

    def may_post_event(self, actor: str) -> None:
        """Post a binding event as ``actor``: an admin, or an engine as itself (the store then
        checks that the step is the actor's, ``store.base.owner_problem``). The proxy posts
        marks, not events: it reports what it saw, it does not move a transfer."""
        if self.role is Role.ADMIN or (self.role is Role.ENGINE and self.covers(actor)):
            return
        raise self._refuse(f"post a binding event as {actor!r}")

    @property
    def engine(self) -> bool:
        return self.role is Role.ENGINE

    def may_mark(self) -> None:
        if self.role not in (Role.ADMIN, Role.PROXY):
            raise self._refuse("post marks")

    def may_share_load(self) -> None:
        """Report a proxy replica's load (and read the others')."""
        if self.role not in (Role.ADMIN, Role.PROXY):
            raise self._refuse("share proxy load")

    def may_administer(self, what: str) -> None:
        if self.role is not Role.ADMIN:
            raise self._refuse(what)


ANONYMOUS = Principal("anonymous", Role.ADMIN)  # open mode: nobody is asked
READER = Principal("anonymous reader", Role.READER)  # an unchecked read


class CredentialEntry(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    name: Annotated[str, Field(min_length=1, max_length=128)]
    role: Role
    token: Annotated[str, Field(min_length=MIN_TOKEN_CHARS)] | None = None
    token_file: Path | None = Field(None, description="read the token from this file instead")
    instance: Annotated[str, Field(pattern=rf"^{ID_BODY}\*?$|^\*$")] | None = None
    engine_role: InstanceRole | None = None
    hosts: Annotated[list[str], Field(min_length=1, max_length=256)] | None = Field(
        None, description="engines: the hosts (addresses, networks, names) it may register"
    )
    max_instances: Annotated[int, Field(ge=1, le=100_000)] | None = Field(
        None,
        description=f"engines: live instances it may hold (default {EXACT_CAP} for one id, "
        f"{POOL_CAP} for a prefix)",
    )

    @model_validator(mode="after")
    def _consistent(self) -> CredentialEntry:
        if (self.token is None) == (self.token_file is None):
            raise ValueError(f"{self.name}: give exactly one of token and token_file")
        if self.role is Role.ENGINE and self.instance is None:
            raise ValueError(f"{self.name}: an engine credential needs instance (an id or prefix*)")
        if self.role is not Role.ENGINE and (
            self.instance or self.engine_role or self.hosts or self.max_instances
        ):
            raise ValueError(
                f"{self.name}: instance, engine_role, hosts and max_instances are for engine "
                "credentials"
            )
        if self.hosts is not None:
            Hosts.parse(self.hosts)
        return self

    def principal(self) -> Principal:
        cap = self.max_instances
        if cap is None and self.role is Role.ENGINE:
            cap = POOL_CAP if (self.instance or "").endswith("*") else EXACT_CAP
        hosts = None if self.hosts is None else Hosts.parse(self.hosts)
        return Principal(self.name, self.role, self.instance, self.engine_role, hosts, cap or 0)

    def secret(self) -> str:
        if self.token is not None:
            return self.token
        assert self.token_file is not None
        token = self.token_file.read_text().strip()
        if len(token) < MIN_TOKEN_CHARS:
            raise ValueError(f"{self.name}: {self.token_file} holds under {MIN_TOKEN_CHARS} chars")
        return token


class CredentialsFile(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    credentials: Annotated[list[CredentialEntry], Field(min_length=1)]


def _digest(token: bytes) -> bytes:
    return hashlib.sha256(token).digest()


class Access:
    """The mode and its credentials; ``who`` turns an Authorization header into a Principal."""

    def __init__(
        self,
        *,
        token: str | None = None,
        entries: list[tuple[str, CredentialEntry]] | None = None,
        protect_reads: bool = True,
    ) -> None:
        self.protect_reads = protect_reads
        self._by_digest: dict[bytes, Principal] = {}
        self._capability_keys: list[bytes] = []  # proxy and admin tokens
        if token is not None:
            self._add(token, Principal("token", Role.ADMIN))
        for secret, e in entries or []:
            self._add(secret, e.principal())
        self.open = not self._by_digest
        self.mode = "roles" if entries else "single token" if token is not None else "open"

    def _add(self, secret: str, who: Principal) -> None:
        digest = _digest(f"Bearer {secret}".encode())
        if digest in self._by_digest:
            raise ValueError(f"{who.name}: the same token appears twice")
        self._by_digest[digest] = who
        if who.role in (Role.ADMIN, Role.PROXY):
            self._capability_keys.append(secret.encode())

    @classmethod
    def load(cls, token: str | None, credentials_file: Path | None, protect_reads: bool) -> Access:
        if credentials_file is not None:
            try:
                raw = yaml.safe_load(credentials_file.read_text())
                parsed = CredentialsFile.model_validate(raw)
                entries = [(e.secret(), e) for e in parsed.credentials]
                return cls(token=token, entries=entries, protect_reads=protect_reads)
            except ValidationError as exc:  # said without the values: they may be tokens
                problems = "; ".join(
                    f"{'.'.join(str(x) for x in e['loc']) or 'file'}: {e['msg']}"
                    for e in exc.errors(include_input=False)
                )
                raise ValueError(f"credentials file {credentials_file}: {problems}") from None
            except (OSError, ValueError, yaml.YAMLError) as exc:
                raise ValueError(f"credentials file {credentials_file}: {exc}") from None
        return cls(token=token, protect_reads=protect_reads)

    def who(self, header: str | bytes | None, *, write: bool) -> Principal:
        """The caller, or 401. An unchecked read (open reads) answers a reader."""
        if self.open:
            return ANONYMOUS
        if not write and not self.protect_reads:
            return READER
        got = header.encode() if isinstance(header, str) else header
        who = None if not got else self._by_digest.get(_digest(got))
        if who is None:
            raise Unauthorized("missing or wrong bearer token")
        if write and who.role is Role.READER:
            raise Forbidden(f"credential {who.name!r} (role reader) may only read")
        return who

    def token_ok(self, token: str) -> bool:
        return self._by_digest.get(_digest(f"Bearer {token}".encode())) is not None

    def capability_ok(self, subject: str, capability: str) -> bool:
        """A vllm-ascend D's per-request capability (``pdwire.ascend.capability``)."""
        return any(
            hmac.compare_digest(make_capability(key, subject), capability)
            for key in self._capability_keys
        )
