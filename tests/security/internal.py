"""A stand-in for a service inside the cluster that nobody outside should read: it answers
every GET and POST, whatever the path, with a secret, and records the paths it was asked for."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

SECRET = "INTERNAL-ONLY-4f1c"


class InternalService:
    def __init__(self) -> None:
        self.paths: list[str] = []
        seen = self.paths

        class Handler(BaseHTTPRequestHandler):
            def _answer(self) -> None:
                seen.append(self.path)
                length = int(self.headers.get("content-length") or 0)
                if length:
                    self.rfile.read(length)
                body = json.dumps({"service": "internal", "secret": SECRET}).encode()
                self.send_response(200)
                self.send_header("content-type", "application/json")
                self.send_header("content-length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            do_GET = do_POST = _answer

            def log_message(self, *args: object) -> None:
                pass

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = int(self._server.server_address[1])
        self.origin = f"http://127.0.0.1:{self.port}"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()
