"""A stand-in for the Kubernetes API server's two calls the metaserver makes about engine pods,
over TLS on loopback. No cluster runs here; what it answers follows the API's own source:

- ``POST /apis/authentication.k8s.io/v1/tokenreviews`` (``TokenReview``, ``TokenReviewSpec``
  ``{token, audiences}``, ``TokenReviewStatus`` ``{authenticated, user, audiences, error}``:
  kubernetes/kubernetes ``staging/src/k8s.io/api/authentication/v1/types.go``). A service
  account's token bound to a pod reviews as ``system:serviceaccount:<ns>:<name>`` with the pod's
  name and uid in ``user.extra["authentication.kubernetes.io/pod-name"|"…/pod-uid"]``
  (``pkg/serviceaccount/claims.go`` puts the pod in the token's private claims; the
  authenticator turns them into these extras). A token for another audience, an expired one or
  one whose pod is gone reviews as ``authenticated: false`` (claims.go ``Validate``); ``status.
  audiences`` is the intersection of the spec's and the token's.
- ``GET /api/v1/namespaces/<ns>/pods/<name>``: a ``Pod`` with ``metadata.uid``,
  ``metadata.deletionTimestamp`` (while terminating), ``spec.serviceAccountName`` and
  ``status.podIP`` / ``status.podIPs`` (``staging/src/k8s.io/api/core/v1/types.go``); 404 with a
  ``Status`` body when there is none.

Both calls need the caller's own bearer token (the metaserver's ServiceAccount: 401 without).
Tokens here are opaque JWT-shaped strings the test mints with ``mint``.
"""

from __future__ import annotations

import base64
import json
import secrets
import ssl
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from tests.support.certs import self_signed


@dataclass
class FakePod:
    namespace: str
    name: str
    service_account: str
    ips: list[str]
    uid: str = field(default_factory=lambda: secrets.token_hex(8))
    terminating: bool = False


@dataclass
class Issued:
    pod: FakePod
    uid: str  # the pod's uid when the token was issued
    audiences: list[str]


class FakeKubeAPI:
    def __init__(self, directory: Path) -> None:
        self.cert = self_signed(directory)
        self.caller_token = secrets.token_urlsafe(24)  # the metaserver's own token
        self.token_file = directory / "metaserver-sa.token"
        self.token_file.write_text(self.caller_token + "\n")
        self.pods: dict[tuple[str, str], FakePod] = {}
        self.tokens: dict[str, Issued] = {}
        self.reviews: list[str] = []  # every token reviewed, in order
        api = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                if not self._authorized():
                    return
                length = int(self.headers.get("content-length") or 0)
                body = json.loads(self.rfile.read(length) or b"{}")
                if self.path != "/apis/authentication.k8s.io/v1/tokenreviews":
                    return self._send(404, _status(404, "NotFound", "the server could not find it"))
                self._send(201, api.review(body))

            def do_GET(self) -> None:
                if not self._authorized():
                    return
                parts = self.path.strip("/").split("/")
                if (
                    len(parts) == 6
                    and parts[:3] == ["api", "v1", "namespaces"]
                    and parts[4] == "pods"
                ):
                    pod = api.pods.get((parts[3], parts[5]))
                    if pod is None:
                        msg = f'pods "{parts[5]}" not found'
                        return self._send(404, _status(404, "NotFound", msg))
                    return self._send(200, _pod(pod))
                self._send(404, _status(404, "NotFound", "the server could not find it"))

            def _authorized(self) -> bool:
                if self.headers.get("authorization") == f"Bearer {api.caller_token}":
                    return True
                self._send(401, _status(401, "Unauthorized", "Unauthorized"))
                return False

            def _send(self, code: int, body: dict[str, Any]) -> None:
                raw = json.dumps(body).encode()
                self.send_response(code)
                self.send_header("content-type", "application/json")
                self.send_header("content-length", str(len(raw)))
                self.end_headers()
                self.wfile.write(raw)

            def log_message(self, *args: object) -> None:
                pass

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        tls = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        tls.load_cert_chain(self.cert.cert, self.cert.key)
        self._server.socket = tls.wrap_socket(self._server.socket, server_side=True)
        self.url = f"https://127.0.0.1:{self._server.server_address[1]}"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._thread.start()

    def add_pod(self, namespace: str, name: str, service_account: str, ip: str) -> FakePod:
        pod = FakePod(namespace, name, service_account, [ip])
        self.pods[(namespace, name)] = pod
        return pod

    def mint(self, pod: FakePod, audiences: tuple[str, ...] = ("pdgate-metaserver",)) -> str:
        """A projected token for ``pod`` (JWT-shaped: three base64url parts)."""

        def part(n: int) -> str:
            return base64.urlsafe_b64encode(secrets.token_bytes(n)).decode().rstrip("=")

        token = f"{part(24)}.{part(96)}.{part(48)}"
        self.tokens[token] = Issued(pod, pod.uid, list(audiences))
        return token

    def review(self, body: dict[str, Any]) -> dict[str, Any]:
        spec = body.get("spec") or {}
        token, wanted = str(spec.get("token", "")), list(spec.get("audiences") or [])
        self.reviews.append(token)
        out: dict[str, Any] = {"apiVersion": "authentication.k8s.io/v1", "kind": "TokenReview",
                               "metadata": {"creationTimestamp": None}, "spec": spec}  # fmt: skip
        issued = self.tokens.get(token)
        shared = [a for a in wanted if issued is not None and a in issued.audiences]
        pod = None if issued is None else self.pods.get((issued.pod.namespace, issued.pod.name))
        if issued is None or not shared or pod is None or pod.uid != issued.uid:
            out["status"] = {"authenticated": False, "user": {},
                             "error": "[invalid bearer token, service account token has been "
                                      "invalidated]"}  # fmt: skip
            return out
        ns, sa = issued.pod.namespace, issued.pod.service_account
        out["status"] = {
            "authenticated": True,
            "user": {
                "username": f"system:serviceaccount:{ns}:{sa}",
                "uid": secrets.token_hex(8),
                "groups": ["system:serviceaccounts", f"system:serviceaccounts:{ns}",
                           "system:authenticated"],
                "extra": {
                    "authentication.kubernetes.io/pod-name": [issued.pod.name],
                    "authentication.kubernetes.io/pod-uid": [issued.uid],
                },
            },
            "audiences": shared,
        }  # fmt: skip
        return out

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()


def _pod(pod: FakePod) -> dict[str, Any]:
    meta: dict[str, Any] = {"name": pod.name, "namespace": pod.namespace, "uid": pod.uid}
    if pod.terminating:
        meta["deletionTimestamp"] = "2026-11-29T00:00:00Z"
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": meta,
        "spec": {"serviceAccountName": pod.service_account, "containers": [{"name": "vllm"}]},
        "status": {"phase": "Running", "podIP": pod.ips[0], "podIPs": [{"ip": i} for i in pod.ips]},
    }


def _status(code: int, reason: str, message: str) -> dict[str, Any]:
    return {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
            "message": message, "reason": reason, "code": code}  # fmt: skip
