"""The credentials file (``--credentials-file``): one entry per bearer token, or per Kubernetes
service account whose pods present their own projected tokens (``metaserver.access.kube``).

```yaml
credentials:
  - {name: ops, role: admin, token_file: /etc/pdgate/admin.token}
  - {name: proxies, role: proxy, token_file: /etc/pdgate/proxy.token}
  - {name: decode-0, role: engine, instance: decode-0, engine_role: decode,
     hosts: [10.0.3.7], token_file: /etc/pdgate/decode-0.token}
  - {name: prefill-pods, role: engine, engine_role: prefill,
     kubernetes: {service_account: "serving:pd-prefill"}}
```
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from metaserver.access.hosts import Hosts
from metaserver.access.principal import Principal, Role
from pdwire.ids import ID_BODY
from pdwire.models import InstanceRole

MIN_TOKEN_CHARS = 16
EXACT_CAP = 1  # registrations an engine credential bound to one id (or one pod) may hold
POOL_CAP = 64  # ... and one bound to a prefix (a pool's pods)
_K8S_NAME = r"[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?"


class KubernetesIdentity(BaseModel):
    """An engine pod's own identity: a token this service account's pods are given."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    service_account: Annotated[str, Field(pattern=rf"^{_K8S_NAME}:{_K8S_NAME}$")] = Field(
        description="<namespace>:<name> of the ServiceAccount the pods run as"
    )


class CredentialEntry(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    name: Annotated[str, Field(min_length=1, max_length=128)]
    role: Role
    token: Annotated[str, Field(min_length=MIN_TOKEN_CHARS)] | None = None
    token_file: Path | None = Field(None, description="read the token from this file instead")
    kubernetes: KubernetesIdentity | None = Field(
        None, description="engines: each pod of this service account acts as itself"
    )
    instance: Annotated[str, Field(pattern=rf"^{ID_BODY}\*?$|^\*$")] | None = None
    engine_role: InstanceRole | None = None
    hosts: Annotated[list[str], Field(min_length=1, max_length=256)] | None = Field(
        None, description="engines: the hosts (addresses, networks, names) it may register"
    )
    max_instances: Annotated[int, Field(ge=1, le=100_000)] | None = Field(
        None,
        description=f"engines: live instances it may hold (default {EXACT_CAP} for one id or "
        f"a pod, {POOL_CAP} for a prefix)",
    )

    @model_validator(mode="after")
    def _consistent(self) -> CredentialEntry:
        given = [x for x in (self.token, self.token_file, self.kubernetes) if x is not None]
        if len(given) != 1:
            raise ValueError(f"{self.name}: give exactly one of token, token_file, kubernetes")
        if self.role is Role.ENGINE and self.instance is None and self.kubernetes is None:
            raise ValueError(f"{self.name}: an engine credential needs instance (an id or prefix*)")
        if self.role is not Role.ENGINE and (
            self.instance or self.engine_role or self.hosts or self.max_instances or self.kubernetes
        ):
            raise ValueError(
                f"{self.name}: instance, engine_role, hosts, max_instances and kubernetes are "
                "for engine credentials"
            )
        if self.kubernetes is not None and self.hosts is not None:
            raise ValueError(f"{self.name}: a pod's hosts are its own addresses, not a list")
        if self.hosts is not None:
            Hosts.parse(self.hosts)
        return self

    def principal(self) -> Principal:
        """Who this token is (a token entry; a Kubernetes entry's principal is per pod)."""
        cap = self.max_instances
        if cap is None and self.role is Role.ENGINE:
            cap = POOL_CAP if (self.instance or "").endswith("*") else EXACT_CAP
        hosts = None if self.hosts is None else Hosts.parse(self.hosts)
        return Principal(self.name, self.role, self.instance, self.engine_role, hosts, cap or 0)

    def pod_principal(self, pod: str, ips: tuple[str, ...]) -> Principal | None:
        """The principal of one pod of a Kubernetes entry: that pod's id and addresses only
        (``None`` when ``instance`` limits the entry to pods named otherwise)."""
        if self.instance is not None and not Principal("", Role.ENGINE, self.instance).covers(pod):
            return None
        return Principal(
            f"{self.name}/{pod}", Role.ENGINE, pod, self.engine_role, Hosts.parse(ips),
            self.max_instances or EXACT_CAP,
        )  # fmt: skip

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


def read_entries(path: Path) -> list[CredentialEntry]:
    """The file's entries; ``ValueError`` naming what is wrong, never a token's value."""
    try:
        parsed = CredentialsFile.model_validate(yaml.safe_load(path.read_text()))
        for entry in parsed.credentials:
            if entry.kubernetes is None:
                entry.secret()  # a token file that does not load fails the start
        return parsed.credentials
    except ValidationError as exc:  # said without the values: they may be tokens
        problems = "; ".join(
            f"{'.'.join(str(x) for x in e['loc']) or 'file'}: {e['msg']}"
            for e in exc.errors(include_input=False)
        )
        raise ValueError(f"credentials file {path}: {problems}") from None
    except (OSError, ValueError, yaml.YAMLError) as exc:
        raise ValueError(f"credentials file {path}: {exc}") from None
