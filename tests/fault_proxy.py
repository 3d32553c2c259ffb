"""A fault-injecting HTTP proxy on loopback, in front of the moto S3 server.

Each request is, with probability `rate`, answered with 500 or 503 SlowDown, or its connection
is reset, before it reaches the server; all other requests are forwarded unchanged, unless the
test asks to answer some itself (`answer`) or to change their path on the way (`rewrite`), as an
S3-compatible server with other habits would.
"""

from __future__ import annotations

import http.client
import random
import socket
import struct
import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import urlsplit

SLOW_DOWN = (
    b'<?xml version="1.0" encoding="UTF-8"?><Error><Code>SlowDown</Code>'
    b"<Message>Please reduce your request rate.</Message></Error>"
)
INTERNAL = (
    b'<?xml version="1.0" encoding="UTF-8"?><Error><Code>InternalError</Code>'
    b"<Message>We encountered an internal error.</Message></Error>"
)


class FaultProxy:
    """Forwards to `upstream`; counts what it injected in `injected`."""

    def __init__(
        self,
        upstream: str,
        rate: float,
        seed: int = 0,
        lose_answer: Callable[[str, str], bool] | None = None,
        answer: Callable[[str, str], tuple[int, bytes] | None] | None = None,
        rewrite: Callable[[str, str], str] | None = None,
    ) -> None:
        """`lose_answer(method, path)`: forward such a request, then reset the connection
        instead of answering (the request took effect; the client never hears so).
        `answer(method, path)`: a (status, XML body) to send instead of forwarding, or None.
        `rewrite(method, path)`: the path to forward instead of `path`."""
        target = urlsplit(upstream)
        self.host, self.port = target.hostname or "127.0.0.1", target.port or 80
        self.rate = rate
        self.random = random.Random(seed)
        self.lock = threading.Lock()
        self.injected = {"500": 0, "503": 0, "reset": 0}
        self.forwarded = 0
        self.lose_answer = lose_answer
        self.answer = answer
        self.rewrite = rewrite
        self.lost: list[str] = []
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def _handle(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(length) if length else b""
                fault = proxy.draw()
                if fault == "reset":
                    self.connection.setsockopt(
                        socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0)
                    )
                    self.close_connection = True
                    return
                if fault in ("500", "503"):
                    self._send_error(int(fault), INTERNAL if fault == "500" else SLOW_DOWN)
                    return
                own = proxy.answer(self.command, self.path) if proxy.answer else None
                if own is not None:
                    self._send_error(*own)
                    return
                path = proxy.rewrite(self.command, self.path) if proxy.rewrite else self.path
                status, headers, data = proxy.forward(self.command, path, self.headers, body)
                if proxy.lose_answer is not None and proxy.lose_answer(self.command, self.path):
                    proxy.lost.append(f"{self.command} {self.path}")
                    self.connection.setsockopt(
                        socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0)
                    )
                    self.close_connection = True
                    return
                self.send_response(status)
                for name, value in headers:
                    if name.lower() not in ("transfer-encoding", "connection", "content-length"):
                        self.send_header(name, value)
                upstream_length = {k.lower(): v for k, v in headers}.get("content-length", "0")
                # a HEAD answer has no body but tells the object's length
                length = upstream_length if self.command == "HEAD" else str(len(data))
                self.send_header("Content-Length", length)
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(data)

            def _send_error(self, status: int, payload: bytes) -> None:
                self.send_response(status)
                self.send_header("Content-Type", "application/xml")
                self.send_header("Content-Length", str(len(payload)))
                self.end_headers()
                self.wfile.write(payload)

            do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _handle

            def log_message(self, *args: object) -> None:
                return None

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    @property
    def endpoint(self) -> str:
        host, port = self.server.server_address[:2]
        return f"http://{host}:{port}"

    def draw(self) -> str | None:
        with self.lock:
            if self.random.random() >= self.rate:
                self.forwarded += 1
                return None
            fault = self.random.choice(["500", "503", "reset"])
            self.injected[fault] += 1
            return fault

    def forward(
        self, method: str, path: str, headers: object, body: bytes
    ) -> tuple[int, list[tuple[str, str]], bytes]:
        connection = http.client.HTTPConnection(self.host, self.port, timeout=60)
        try:
            forwarded = {k: v for k, v in headers.items() if k.lower() != "connection"}  # type: ignore[attr-defined]
            connection.request(method, path, body=body, headers=forwarded)
            response = connection.getresponse()
            return response.status, response.getheaders(), response.read()
        finally:
            connection.close()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
