"""A loopback stand-in for the Kubernetes API, just enough for Helm's `lookup` of Secrets.

No cluster runs here; Helm's cluster-aware render (helm_python.Config.render) asks this server
for existing objects the way `helm upgrade` asks a real API server.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

_RESOURCES = {
    "kind": "APIResourceList",
    "groupVersion": "v1",
    "resources": [
        {
            "name": "secrets",
            "singularName": "secret",
            "namespaced": True,
            "kind": "Secret",
            "verbs": ["get", "list"],
        },
    ],
}


class FakeKubeAPI:
    def __init__(self) -> None:
        self.secrets: dict[tuple[str, str], dict[str, Any]] = {}
        self.requests: list[str] = []

    def put_secret(self, manifest: dict[str, Any]) -> None:
        meta = manifest["metadata"]
        self.secrets[(meta["namespace"], meta["name"])] = manifest

    def answer(self, path: str) -> tuple[int, dict[str, Any]]:
        self.requests.append(path)
        parts = path.split("?")[0].strip("/").split("/")
        if parts == ["api", "v1"]:
            return 200, _RESOURCES
        if len(parts) == 6 and parts[:3] == ["api", "v1", "namespaces"] and parts[4] == "secrets":
            found = self.secrets.get((parts[3], parts[5]))
            if found is not None:
                return 200, found
        return 404, {
            "kind": "Status",
            "apiVersion": "v1",
            "status": "Failure",
            "reason": "NotFound",
            "code": 404,
        }


@contextmanager
def serve(api: FakeKubeAPI) -> Iterator[str]:
    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            status, body = api.answer(self.path)
            data = json.dumps(body).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
        thread.join(5)
