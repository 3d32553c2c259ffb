"""A cloud model on loopback: an HTTP proxy in front of an S3 server that behaves like a real one.

A loopback server answers in microseconds, never throttles and has no bandwidth limit, so
nothing measured against it says how a save behaves in a data centre. `CloudProxy` sits between
spotckpt and the S3 server (moto or SeaweedFS) and imposes, per `Profile`:

- a bandwidth per connection (each direction), paced in slices of `SLICE` bytes;
- an aggregate cap per node and direction (full duplex, as a NIC is): every connection of one
  proxy shares it (one proxy is one node; its `NodeLinks` may also pace other traffic of the
  node, such as the fast tier's peer exchange);
- a first-byte latency before each answer;
- request rates per prefix (the key up to its last ``/``, as a partitioned S3 prefix), writes
  (PUT, POST, DELETE) and reads (GET, HEAD) apart, as token buckets; a request beyond them is
  answered ``503 SlowDown`` with S3's XML error body, as S3 does, and never reaches the server.
  A rate may ramp (GCS doubles a bucket's write rate about every 20 minutes).

It counts every request it saw by method and by what S3 bills it as (`counts`), the bytes each
way, and what it throttled. The profiles and their sources are in docs/cloud-model.md.

Nothing here contacts a non-loopback address.
"""

from __future__ import annotations

import http.client
import socket
import threading
import time
from collections import Counter
from dataclasses import dataclass, replace
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import urlsplit

MIB = 1 << 20
SLICE = 256 * 1024
"""Bytes paced at a time: small enough to share a link fairly, large enough to copy fast."""

SLOW_DOWN = (
    b'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>SlowDown</Code>'
    b"<Message>Please reduce your request rate.</Message>"
    b"<RequestId>cloud-model</RequestId></Error>"
)
_HOP_BY_HOP = frozenset(
    {"connection", "keep-alive", "transfer-encoding", "content-length", "expect", "te", "upgrade"}
)


@dataclass(frozen=True)
class Profile:
    """The limits of one object store as seen from one node; None or 0 switches a limit off."""

    name: str
    connection_bytes_per_s: float | None
    node_bytes_per_s: float | None
    first_byte_s: float
    writes_per_s: float | None
    reads_per_s: float | None
    burst_s: float = 0.1
    """How many seconds of a request rate a quiet prefix may spend at once."""
    ramp_doubling_s: float | None = None
    """Rates double every so many seconds of load (GCS's ramp-up); None: constant."""

    def scaled(self, **changes: Any) -> Profile:
        """This profile with some limits changed (a benchmark's variant)."""
        return replace(self, **changes)


GBIT = 1e9 / 8
PROFILES: dict[str, Profile] = {
    # S3 Standard: ~5 Gbit/s per connection, 20-80 ms to the first byte, 3,500 PUT/COPY/POST/
    # DELETE and 5,500 GET/HEAD per second per partitioned prefix; a 25 Gbit/s node.
    "s3-standard": Profile("s3-standard", 5 * GBIT, 25 * GBIT, 0.03, 3500, 5500),
    # GCS: similar per-stream throughput; a new bucket starts near 1,000 writes and 5,000 reads
    # per second and doubles that about every 20 minutes under sustained load.
    "gcs": Profile("gcs", 5 * GBIT, 25 * GBIT, 0.04, 1000, 5000, ramp_doubling_s=1200.0),
    # S3 Express One Zone (directory buckets): single-digit ms latency, up to 200,000 reads and
    # 100,000 writes per second per bucket (not per prefix: modelled as very high rates).
    "s3-express": Profile("s3-express", 10 * GBIT, 25 * GBIT, 0.004, 100_000, 200_000),
    # Scaled so that its limits bind at the request rates one 2-core machine produces: a save
    # of 32 ranks into one prefix hits the write rate, the bandwidth limits stay in reach.
    "stress": Profile("stress", 64 * MIB, 256 * MIB, 0.005, 20, 60, burst_s=0.25),
}


def profile(name: str) -> Profile:
    """The named profile (see `PROFILES`)."""
    try:
        return PROFILES[name]
    except KeyError:
        raise ValueError(f"unknown cloud profile {name!r}; known: {sorted(PROFILES)}") from None


class Link:
    """A paced link of `rate` bytes per second, shared by whoever holds it (FIFO reservations)."""

    def __init__(self, rate: float | None) -> None:
        self.rate = rate or None
        self.lock = threading.Lock()
        self.free_at = 0.0

    def take(self, size: int) -> float:
        """Reserve `size` bytes; returns the instant they may go (the caller waits)."""
        now = time.monotonic()
        if self.rate is None:
            return now
        with self.lock:
            start = max(now, self.free_at)
            self.free_at = start + size / self.rate
            return self.free_at


@dataclass(frozen=True)
class NodeLinks:
    """One node's network interface: what it sends (`up`) and what it receives (`down`) are
    paced apart, so that a node can upload and download at full rate at once."""

    up: Link
    down: Link

    @classmethod
    def of(cls, rate: float | None) -> NodeLinks:
        """Both directions at `rate` bytes per second (None: unlimited)."""
        return cls(Link(rate), Link(rate))


class RateLimit:
    """A token bucket of `rate` requests per second with `burst_s` seconds of credit."""

    def __init__(self, rate: float, burst_s: float, doubling_s: float | None, start: float) -> None:
        self.base = rate
        self.capacity_s = burst_s
        self.doubling_s = doubling_s
        self.start = start
        self.tokens = max(1.0, rate * burst_s)
        self.at = start

    def rate(self, now: float) -> float:
        if self.doubling_s is None:
            return self.base
        return self.base * 2 ** ((now - self.start) / self.doubling_s)

    def allow(self, now: float) -> bool:
        rate = self.rate(now)
        self.tokens = min(max(1.0, rate * self.capacity_s), self.tokens + (now - self.at) * rate)
        self.at = now
        if self.tokens >= 1.0:
            self.tokens -= 1.0
            return True
        return False


def billing_class(method: str, query: str) -> str:
    """What S3 bills a request as: "write" (PUT, COPY, POST, LIST), "read" (GET, HEAD, and
    others), "free" (DELETE, DeleteObjects)."""
    if method == "DELETE" or (method == "POST" and "delete" in query):
        return "free"  # DeleteObjects too, as spotckpt counts it
    if method in ("PUT", "POST"):
        return "write"
    if method == "GET" and ("list-type" in query or "uploads" in query or "uploadId" in query):
        return "write"  # ListObjectsV2, ListMultipartUploads, ListParts
    return "read"


def rate_prefix(path: str) -> str:
    """The partition a request counts against: bucket and key up to the last ``/``."""
    return path.split("?", 1)[0].rsplit("/", 1)[0]


class CloudProxy:
    """Forwards to `upstream` under `profile`'s limits; see the module docstring."""

    def __init__(self, upstream: str, profile: Profile, node: NodeLinks | None = None) -> None:
        target = urlsplit(upstream)
        self.host, self.port = target.hostname or "127.0.0.1", target.port or 80
        self.profile = profile
        self.node = node or NodeLinks.of(profile.node_bytes_per_s)
        self.lock = threading.Lock()
        self.started = time.monotonic()
        self.limits: dict[tuple[str, str], RateLimit] = {}
        self.counts: Counter[str] = Counter()
        """Requests seen, by method ("PUT", ...) and by billing class ("write", "read", "free")."""
        self.throttled: Counter[str] = Counter()
        """Requests answered 503 SlowDown, by billing class."""
        self.bytes_in = 0
        self.bytes_out = 0
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"
            rbufsize = 1 << 20
            upstream: http.client.HTTPConnection | None = None

            def handle_expect_100(self) -> bool:
                if proxy.admit(self.command, self.path):
                    self.admitted = True
                    return super().handle_expect_100()
                self._slow_down()  # the client never sends its body: the connection closes
                return False

            def _handle(self) -> None:
                admitted = getattr(self, "admitted", None)
                self.admitted = None
                if admitted is None and not proxy.admit(self.command, self.path):
                    self._discard_body()
                    self._slow_down()
                    return
                link = Link(proxy.profile.connection_bytes_per_s)
                try:
                    self._forward(link)
                except (OSError, http.client.HTTPException):
                    self.close_connection = True
                    self._drop_upstream()

            def _discard_body(self) -> None:
                left = int(self.headers.get("Content-Length") or 0)
                while left > 0:
                    got = self.rfile.read(min(left, 1 << 20))
                    if not got:
                        break
                    left -= len(got)

            def _slow_down(self) -> None:
                self.send_response(503)
                self.send_header("Content-Type", "application/xml")
                self.send_header("Content-Length", str(len(SLOW_DOWN)))
                self.send_header("Connection", "close")
                self.end_headers()
                self.wfile.write(SLOW_DOWN)
                self.close_connection = True

            def _connection(self) -> http.client.HTTPConnection:
                if self.upstream is None:
                    self.upstream = http.client.HTTPConnection(proxy.host, proxy.port, timeout=120)
                return self.upstream

            def _drop_upstream(self) -> None:
                if self.upstream is not None:
                    self.upstream.close()
                    self.upstream = None

            def _forward(self, link: Link) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                upstream = self._connection()
                upstream.putrequest(
                    self.command, self.path, skip_host=True, skip_accept_encoding=True
                )
                for name, value in self.headers.items():
                    if name.lower() not in _HOP_BY_HOP:
                        upstream.putheader(name, value)
                if length or self.command in ("PUT", "POST"):
                    upstream.putheader("Content-Length", str(length))
                upstream.endheaders()
                buffer = bytearray(SLICE)
                view = memoryview(buffer)
                left = length
                while left > 0:
                    got = self.rfile.readinto(view[: min(left, SLICE)])
                    if not got:
                        raise ConnectionError("the client closed the connection mid-body")
                    proxy.pace(link, proxy.node.up, got)
                    upstream.send(view[:got])
                    left -= got
                with proxy.lock:
                    proxy.bytes_in += length
                response = upstream.getresponse()
                time.sleep(proxy.profile.first_byte_s)
                self._answer(response, link, view)
                if response.will_close:
                    self._drop_upstream()

            def _answer(
                self, response: http.client.HTTPResponse, link: Link, view: memoryview
            ) -> None:
                headers = response.getheaders()
                declared = response.getheader("Content-Length")
                body: bytes | None = None
                if self.command == "HEAD":
                    size = int(declared or 0)
                elif declared is None:
                    body = response.read()
                    size = len(body)
                else:
                    size = int(declared)
                self.send_response(response.status, response.reason)
                for name, value in headers:
                    if name.lower() not in _HOP_BY_HOP:
                        self.send_header(name, value)
                self.send_header("Content-Length", str(size))
                self.end_headers()
                if self.command == "HEAD":
                    response.read()
                    return
                sent = 0
                if body is not None:
                    for start in range(0, size, SLICE):
                        piece = body[start : start + SLICE]
                        proxy.pace(link, proxy.node.down, len(piece))
                        self.wfile.write(piece)
                    sent = size
                else:
                    while sent < size:
                        got = response.readinto(view[: min(SLICE, size - sent)])
                        if not got:
                            raise ConnectionError("the server closed the connection mid-body")
                        proxy.pace(link, proxy.node.down, got)
                        self.wfile.write(view[:got])
                        sent += got
                with proxy.lock:
                    proxy.bytes_out += sent

            def finish(self) -> None:
                super().finish()
                self._drop_upstream()

            do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _handle

            def log_message(self, *args: object) -> None:
                return None

        class Server(ThreadingHTTPServer):
            daemon_threads = True
            request_queue_size = 256

            def server_bind(self) -> None:
                self.socket.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                super().server_bind()

        self.server = Server(("127.0.0.1", 0), Handler)
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    @property
    def endpoint(self) -> str:
        """The URL clients use instead of the server's."""
        host, port = self.server.server_address[:2]
        return f"http://{host}:{port}"

    def admit(self, method: str, path: str) -> bool:
        """Count one request; False when its prefix is over its rate (it gets SlowDown)."""
        query = urlsplit(path).query
        kind = billing_class(method, query)
        write = method in ("PUT", "POST", "DELETE")
        rate = self.profile.writes_per_s if write else self.profile.reads_per_s
        now = time.monotonic()
        with self.lock:
            self.counts[method] += 1
            self.counts[kind] += 1
            if not rate:
                return True
            key = ("w" if write else "r", rate_prefix(path))
            limit = self.limits.get(key)
            if limit is None:
                limit = self.limits[key] = RateLimit(
                    rate, self.profile.burst_s, self.profile.ramp_doubling_s, self.started
                )
            if limit.allow(now):
                return True
            self.throttled[kind] += 1
            return False

    def pace(self, link: Link, node: Link, size: int) -> None:
        """Wait until `size` bytes may pass both this connection's link and the node's link in
        their direction (`node`)."""
        until = max(link.take(size), node.take(size))
        delay = until - time.monotonic()
        if delay > 0:
            time.sleep(delay)

    def reset_counts(self) -> None:
        """Forget what was counted so far (between the phases of a benchmark)."""
        with self.lock:
            self.counts.clear()
            self.throttled.clear()
            self.bytes_in = self.bytes_out = 0

    def close(self) -> None:
        """Stop serving; open connections end with their threads."""
        self.server.shutdown()
        self.server.server_close()
