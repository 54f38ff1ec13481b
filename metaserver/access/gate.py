"""``Access``: the mode and its credentials; ``resolve`` turns an Authorization header into the
``Principal`` that made the call."""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Callable
from pathlib import Path

from metaserver.access.credentials import CredentialEntry, read_entries
from metaserver.access.kube import KubeReviewer
from metaserver.access.principal import ANONYMOUS, READER, Principal, Role
from metaserver.errors import Forbidden, Unauthorized
from pdwire.ascend import capability as make_capability


def _digest(token: bytes) -> bytes:
    return hashlib.sha256(token).digest()


class Access:
    def __init__(
        self,
        *,
        token: str | None = None,
        entries: list[CredentialEntry] | None = None,
        protect_reads: bool = True,
        reviewer: Callable[[], KubeReviewer] | None = None,
    ) -> None:
        """``reviewer`` makes the Kubernetes token reviewer that ``kubernetes`` entries need
        (``metaserver.access.kube``); it is made when one is listed."""
        self.protect_reads = protect_reads
        self._by_digest: dict[bytes, Principal] = {}
        self._capability_keys: list[bytes] = []  # proxy and admin tokens
        self._pods: dict[str, CredentialEntry] = {}  # service account -> its entry
        if token is not None:
            self._add(token, Principal("token", Role.ADMIN))
        for e in entries or []:
            if e.kubernetes is None:
                self._add(e.secret(), e.principal())
            elif e.kubernetes.service_account in self._pods:
                raise ValueError(f"{e.name}: {e.kubernetes.service_account} is listed twice")
            else:
                self._pods[e.kubernetes.service_account] = e
        self.reviewer: KubeReviewer | None = None
        if self._pods:
            if reviewer is None:
                raise ValueError("kubernetes credentials need the Kubernetes API (--kube-api)")
            self.reviewer = reviewer()
        self.open = not self._by_digest and not self._pods
        self.mode = "roles" if entries else "single token" if token is not None else "open"

    def _add(self, secret: str, who: Principal) -> None:
        digest = _digest(f"Bearer {secret}".encode())
        if digest in self._by_digest:
            raise ValueError(f"{who.name}: the same token appears twice")
        self._by_digest[digest] = who
        if who.role in (Role.ADMIN, Role.PROXY):
            self._capability_keys.append(secret.encode())

    @classmethod
    def load(
        cls,
        token: str | None,
        credentials_file: Path | None,
        protect_reads: bool,
        reviewer: Callable[[], KubeReviewer] | None = None,
    ) -> Access:
        entries = None if credentials_file is None else read_entries(credentials_file)
        try:
            return cls(token=token, entries=entries, protect_reads=protect_reads, reviewer=reviewer)
        except ValueError as exc:
            raise ValueError(f"credentials file {credentials_file}: {exc}") from None

    async def resolve(self, header: str | bytes | None, *, write: bool) -> Principal:
        """The caller, or 401. An unchecked read (open reads) answers a reader. A token no
        entry holds is a pod's when the Kubernetes API says so."""
        if self.open:
            return ANONYMOUS
        if not write and not self.protect_reads:
            return READER
        got = header.encode() if isinstance(header, str) else header
        who = None if not got else self._by_digest.get(_digest(got))
        if who is None and got and self.reviewer is not None and got[:7].lower() == b"bearer ":
            who = await self._pod(got[7:].strip())
        if who is None:
            raise Unauthorized("missing or wrong bearer token")
        if write and who.role is Role.READER:
            raise Forbidden(f"credential {who.name!r} (role reader) may only read")
        return who

    async def _pod(self, token: bytes) -> Principal | None:
        assert self.reviewer is not None
        pod = await self.reviewer.pod_of(token)
        entry = None if pod is None else self._pods.get(pod.service_account)
        if pod is None or entry is None:
            return None
        return entry.pod_principal(pod.name, pod.ips)

    def token_ok(self, token: str) -> bool:
        return self._by_digest.get(_digest(f"Bearer {token}".encode())) is not None

    def capability_ok(self, subject: str, capability: str) -> bool:
        """A vllm-ascend D's per-request capability (``pdwire.ascend.capability``)."""
        return any(
            hmac.compare_digest(make_capability(key, subject), capability)
            for key in self._capability_keys
        )

    async def close(self) -> None:
        if self.reviewer is not None:
            await self.reviewer.close()
