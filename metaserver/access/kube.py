"""Engine pods' own identity on Kubernetes: a projected ServiceAccount token, reviewed by the API.

Each engine pod presents its projected ServiceAccount token (audience ``pdgate-metaserver``; the
kubelet rotates it) as its bearer token. The metaserver asks the API server who that is
(``TokenReview``, ``authentication.k8s.io/v1``): a token bound to a pod reviews as
``system:serviceaccount:<namespace>:<name>`` with the pod's name and uid in its extra
(``authentication.kubernetes.io/pod-name``, ``…/pod-uid``). It then reads the pod
(``GET /api/v1/namespaces/<ns>/pods/<name>``) for its addresses, checking the uid (a pod of the
same name made since is another pod), its service account and that it is not being deleted. A
credentials entry ``kubernetes: {service_account: "<ns>:<name>"}`` then acts as that one pod:
instance id = the pod's name, its URL and KV endpoint on the pod's own addresses, one live
registration. A compromised pod acts only as itself.

Reviews are cached per token for ``CACHE_S`` (a deleted pod's token is refused at the latest that
much later), refusals for ``REFUSED_S``; at most ``MAX_CACHED`` tokens are kept, at most
``MAX_REVIEWS`` reviews run at once (more answer 503 and are asked again by the client), and only
tokens shaped like a JWT are sent, so a caller spraying made-up tokens costs the API server
little. The metaserver's own ServiceAccount needs ``create`` on ``tokenreviews`` and ``get`` on
``pods`` in the namespaces it serves (the chart's RBAC).
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import os
import re
import ssl
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp

from metaserver.errors import IdentityUnavailable

log = logging.getLogger("pdgate.metaserver.kube")

IN_CLUSTER = Path("/var/run/secrets/kubernetes.io/serviceaccount")
AUDIENCE = "pdgate-metaserver"
CACHE_S = 60.0
REFUSED_S = 5.0
MAX_CACHED = 10_000
MAX_REVIEWS = 16
TIMEOUT_S = 5.0
_JWT = re.compile(rb"[A-Za-z0-9_-]{2,2048}\.[A-Za-z0-9_-]{2,8192}\.[A-Za-z0-9_-]{2,2048}")
POD_NAME = "authentication.kubernetes.io/pod-name"
POD_UID = "authentication.kubernetes.io/pod-uid"


@dataclass(frozen=True, slots=True)
class Pod:
    """Who a token is: its service account (``namespace:name``), its pod and the pod's IPs."""

    service_account: str
    name: str
    uid: str
    ips: tuple[str, ...]


def in_cluster_url() -> str:
    """The API server as a pod sees it (``KUBERNETES_SERVICE_HOST``/``_PORT``); '' outside."""
    host, port = (
        os.environ.get("KUBERNETES_SERVICE_HOST"),
        os.environ.get("KUBERNETES_SERVICE_PORT", "443"),
    )
    if not host:
        return ""
    return f"https://[{host}]:{port}" if ":" in host else f"https://{host}:{port}"


class KubeReviewer:
    """Turns a bearer token into the ``Pod`` it belongs to (``None``: not a pod's valid token).
    ``IdentityUnavailable`` (503) when the API server cannot answer now."""

    def __init__(
        self,
        api_url: str,
        *,
        audience: str = AUDIENCE,
        ca_file: Path | None = None,
        token_file: Path | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._url = api_url.rstrip("/")
        self._audience = audience
        self._ca_file = ca_file
        self._token_file = token_file
        self._clock = clock
        self._session: aiohttp.ClientSession | None = None
        self._cache: OrderedDict[bytes, tuple[float, Pod | None]] = OrderedDict()
        self._pending: dict[bytes, asyncio.Future[Pod | None]] = {}
        self._slots = asyncio.Semaphore(MAX_REVIEWS)
        self.reviews = 0  # TokenReview calls made (not answered from the cache)

    async def pod_of(self, token: bytes) -> Pod | None:
        if not _JWT.fullmatch(token):
            return None
        key = hashlib.sha256(token).digest()
        cached = self._cache.get(key)
        if cached is not None and cached[0] > self._clock():
            self._cache.move_to_end(key)
            return cached[1]
        pending = self._pending.get(key)
        if pending is not None:  # the same token asked meanwhile: one review for both
            return await asyncio.shield(pending)
        future: asyncio.Future[Pod | None] = asyncio.get_running_loop().create_future()
        self._pending[key] = future
        try:
            pod = await self._review(token.decode())
        except BaseException as exc:
            future.set_exception(exc)
            future.exception()  # retrieved: a waiter may not exist
            raise
        finally:
            del self._pending[key]
        future.set_result(pod)
        self._cache[key] = (self._clock() + (CACHE_S if pod else REFUSED_S), pod)
        while len(self._cache) > MAX_CACHED:
            self._cache.popitem(last=False)
        return pod

    async def _review(self, token: str) -> Pod | None:
        if self._slots.locked():
            raise IdentityUnavailable("too many token reviews at once; try again")
        async with self._slots:
            self.reviews += 1
            review = await self._call("POST", "/apis/authentication.k8s.io/v1/tokenreviews", {
                "apiVersion": "authentication.k8s.io/v1",
                "kind": "TokenReview",
                "spec": {"token": token, "audiences": [self._audience]},
            })  # fmt: skip
            status = review.get("status") or {}
            user = status.get("user") or {}
            if not status.get("authenticated") or self._audience not in (
                status.get("audiences") or [self._audience]
            ):
                return None
            parts = str(user.get("username", "")).split(":")
            extra = user.get("extra") or {}
            names, uids = extra.get(POD_NAME) or [], extra.get(POD_UID) or []
            if len(parts) != 4 or parts[:2] != ["system", "serviceaccount"] or not names:
                return None  # not a service account's token bound to a pod
            namespace, account, name = parts[2], parts[3], str(names[0])
            pod = await self._call("GET", f"/api/v1/namespaces/{namespace}/pods/{name}", None)
            meta, spec, st = pod.get("metadata") or {}, pod.get("spec") or {}, pod.get("status")
            if (
                meta.get("uid") != (uids[0] if uids else None)
                or meta.get("deletionTimestamp")
                or spec.get("serviceAccountName") != account
            ):
                return None
            st = st or {}
            ips = tuple(str(p["ip"]) for p in st.get("podIPs") or [] if p.get("ip")) or (
                (str(st["podIP"]),) if st.get("podIP") else ()
            )
            return Pod(f"{namespace}:{account}", name, str(meta["uid"]), ips)

    async def _call(self, method: str, path: str, body: dict[str, Any] | None) -> dict[str, Any]:
        headers = {"accept": "application/json"}
        if self._token_file is not None:
            headers["authorization"] = f"Bearer {self._token_file.read_text().strip()}"
        try:
            async with self._client().request(
                method, self._url + path, json=body, headers=headers,
                timeout=aiohttp.ClientTimeout(total=TIMEOUT_S),
            ) as resp:  # fmt: skip
                if resp.status == 404 and method == "GET":
                    return {}  # no such pod: nobody's token
                if resp.status >= 300:
                    text = (await resp.text())[:200]
                    raise IdentityUnavailable(
                        f"kubernetes API {method} {path}: {resp.status} {text}"
                    )
                answer: dict[str, Any] = await resp.json()
                return answer
        except (aiohttp.ClientError, TimeoutError, OSError) as exc:
            raise IdentityUnavailable(f"kubernetes API unreachable: {exc!r}") from None

    def _client(self) -> aiohttp.ClientSession:
        if self._session is None:
            tls = ssl.create_default_context(cafile=str(self._ca_file) if self._ca_file else None)
            self._session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(ssl=tls))
        return self._session

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None
