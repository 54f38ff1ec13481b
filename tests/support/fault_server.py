"""A scriptable HTTP server on loopback for fault injection (status codes, delays, resets)."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


@dataclass
class Reply:
    status: int = 200
    body: bytes = b"{}"
    delay_s: float = 0.0
    reset: bool = False  # close the connection without answering
    close_after: bool = False  # answer (keep-alive, as far as the client knows), then close
    hold: threading.Event | None = None  # answer only once the test sets it (or the server ends)


@dataclass
class FaultServer:
    replies: list[Reply] = field(default_factory=list)
    default: Reply = field(default_factory=Reply)
    requests: list[tuple[str, str, bytes]] = field(default_factory=list)
    port: int = 0
    connections: int = 0  # connections accepted (keep-alive reuse shows as fewer)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def next_reply(self) -> Reply:
        return self.replies.pop(0) if self.replies else self.default


@contextmanager
def fault_server(*replies: Reply, default: Reply | None = None) -> Iterator[FaultServer]:
    state = FaultServer(list(replies), default or Reply())

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args: object) -> None:
            pass

        def _handle(self) -> None:
            length = int(self.headers.get("content-length") or 0)
            body = self.rfile.read(length) if length else b""
            state.requests.append((self.command, self.path, body))
            reply = state.next_reply()
            if reply.delay_s:
                time.sleep(reply.delay_s)
            if reply.hold is not None:
                reply.hold.wait()
            if reply.reset:
                self.connection.setsockopt(
                    socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00"
                )
                self.close_connection = True
                return
            self.send_response(reply.status)
            self.send_header("content-type", "application/json")
            self.send_header("content-length", str(len(reply.body)))
            self.end_headers()
            self.wfile.write(reply.body)
            if reply.close_after:
                self.close_connection = True

        do_GET = do_PUT = do_POST = do_DELETE = _handle

    class Server(ThreadingHTTPServer):
        def get_request(self) -> tuple[socket.socket, object]:
            got = super().get_request()
            state.connections += 1
            return got

    server = Server(("127.0.0.1", 0), Handler)
    server.daemon_threads = True
    state.port = server.server_address[1]
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield state
    finally:
        for reply in (*replies, state.default):  # no handler thread stays waiting
            if reply.hold is not None:
                reply.hold.set()
        server.shutdown()
        server.server_close()
