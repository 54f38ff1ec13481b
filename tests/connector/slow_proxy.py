"""A reverse proxy that holds each request ``delay_s`` before forwarding (a slow metaserver), or
until the test sets ``hold``."""

from __future__ import annotations

import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx


class SlowProxy:
    def __init__(self, upstream: str, delay_s: float, hold: threading.Event | None = None) -> None:
        self.upstream = upstream.rstrip("/")
        self.delay_s = delay_s
        self.hold = hold
        self.hits: list[tuple[float, str, str]] = []  # (arrival, method, path)
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            def _forward(self) -> None:
                proxy.hits.append((time.monotonic(), self.command, self.path))
                body = self.rfile.read(int(self.headers.get("content-length") or 0))
                time.sleep(proxy.delay_s)
                if proxy.hold is not None:
                    proxy.hold.wait()
                headers = {k: v for k, v in self.headers.items() if k.lower() != "host"}
                try:
                    resp = httpx.request(
                        self.command, proxy.upstream + self.path, content=body, headers=headers
                    )
                except httpx.HTTPError:
                    self.send_error(502)  # the upstream went away (test teardown)
                    return
                self.send_response(resp.status_code)
                self.send_header("content-type", resp.headers.get("content-type", "text/plain"))
                self.send_header("content-length", str(len(resp.content)))
                self.end_headers()
                self.wfile.write(resp.content)

            do_GET = do_PUT = do_POST = do_DELETE = _forward

            def log_message(self, *args: object) -> None:
                return None

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._thread.start()

    def close(self) -> None:
        if self.hold is not None:
            self.hold.set()
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(5)
