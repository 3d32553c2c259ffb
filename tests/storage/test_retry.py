"""RetryPolicy: total deadlines (also against answers that trickle in) and quiet, one-line logs."""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest

from spotckpt.storage import RetryPolicy, StorageError, open_store
from spotckpt.storage.retry import DeadlineExceededError

MIB = 1 << 20
WAIT_S = 60.0  # bound of every wait: many times the 2 s deadline, far below the trickle's time
DEADLINE = RetryPolicy(max_attempts=3, initial_backoff_s=0.01, max_backoff_s=0.05, deadline_s=2)


class SlowServer:
    """A loopback HTTP server that answers every GET with a valid 1 MiB answer, slowly.

    ``trickle`` sends one byte of the body per second; ``stall`` sends the headers and then
    nothing; ``bad-crc`` sends a small body whose ``X-Goog-Hash`` does not match it.
    """

    def __init__(self, mode: str) -> None:
        self.mode = mode
        self.stop = threading.Event()
        self.requests: list[str] = []
        self.body_bytes_sent = 0
        server = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                server.requests.append(self.path)
                if server.mode == "bad-crc":
                    self._headers(200, 5, {"X-Goog-Hash": "crc32c=AAAAAA==,md5=x"})
                    self.wfile.write(b"hello")
                    return
                ranged = "Range" in self.headers
                self._headers(206 if ranged else 200, MIB, {"ETag": '"e"'})
                self.wfile.flush()
                while server.mode == "trickle" and not server.stop.wait(1.0):
                    try:
                        self.wfile.write(b"x")
                        self.wfile.flush()
                    except OSError:
                        return  # the client gave up
                    server.body_bytes_sent += 1
                server.stop.wait(WAIT_S)

            def _headers(self, status: int, length: int, extra: dict[str, str]) -> None:
                self.send_response(status)
                self.send_header("Content-Type", "application/octet-stream")
                self.send_header("Content-Length", str(length))
                if status == 206:
                    self.send_header("Content-Range", f"bytes 0-{length - 1}/{length}")
                for name, value in extra.items():
                    self.send_header(name, value)
                self.end_headers()

            def log_message(self, *args: Any) -> None:
                return None

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}"

    def close(self) -> None:
        self.stop.set()
        self.server.shutdown()
        self.server.server_close()


def _open(kind: str, endpoint: str, retry: RetryPolicy) -> Any:
    if kind == "s3":
        return open_store(
            "s3://slow-bucket/run",
            endpoint_url=endpoint,
            region_name="us-east-1",
            aws_access_key_id="AKIDTEST",
            aws_secret_access_key="not-a-secret",
            retry=retry,
        )
    return open_store("gs://slow-bucket/run", endpoint_url=endpoint, anonymous=True, retry=retry)


@pytest.fixture
def slow(request: pytest.FixtureRequest) -> Iterator[SlowServer]:
    server = SlowServer(request.param)
    yield server
    server.close()


def _run_bounded(fn: Any) -> BaseException | None:
    """Run `fn` on a thread; its error, or None. Fails the test if it is still running."""
    done = threading.Event()
    outcome: list[BaseException | None] = [None]

    def run() -> None:
        try:
            fn()
        except BaseException as error:
            outcome[0] = error
        finally:
            done.set()

    threading.Thread(target=run, daemon=True).start()
    assert done.wait(WAIT_S), f"still running after {WAIT_S} s with a 2 s deadline"
    return outcome[0]


@pytest.mark.process
@pytest.mark.parametrize("slow", ["trickle", "stall"], indirect=True)
@pytest.mark.parametrize("operation", ["get", "get_range", "get_range_into"])
@pytest.mark.parametrize("kind", ["s3", "gcs"])
def test_deadline_bounds_a_slow_body(slow: SlowServer, kind: str, operation: str) -> None:
    store = _open(kind, slow.endpoint, DEADLINE)
    try:
        if operation == "get":
            error = _run_bounded(lambda: store.get("k"))
        elif operation == "get_range":
            error = _run_bounded(lambda: store.get_range("k", 0, MIB))
        else:
            error = _run_bounded(lambda: store.get_range_into("k", 0, memoryview(bytearray(MIB))))
    finally:
        slow.stop.set()
        store.close()
    assert isinstance(error, DeadlineExceededError), repr(error)
    text = str(error)
    scheme = "s3" if kind == "s3" else "gs"
    assert "get " in text and f"{scheme}://slow-bucket/run/k" in text
    assert "deadline of 2 s" in text and "reading the answer" in text
    assert slow.body_bytes_sent < MIB // 100  # it gave up long before the body was in


@pytest.mark.process
@pytest.mark.parametrize("slow", ["bad-crc"], indirect=True)
def test_gcs_read_checks_crc32c_and_retries(slow: SlowServer) -> None:
    store = _open("gcs", slow.endpoint, DEADLINE)
    try:
        with pytest.raises(StorageError, match="CRC32C mismatch"):
            store.get("k")
    finally:
        store.close()
    assert len(slow.requests) == DEADLINE.max_attempts
    assert all(p.startswith("/download/storage/v1/b/slow-bucket/o/run%2Fk?") for p in slow.requests)


# Logging -------------------------------------------------------------------------------------


class Flaky(Exception):
    """A transient error whose text spans lines."""


def _failing(failures: int) -> Any:
    calls = {"n": 0}

    def fn() -> str:
        calls["n"] += 1
        if calls["n"] <= failures:
            raise Flaky(f"try {calls['n']} failed\nTraceback-like second line")
        return "ok"

    return fn


def _records(caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.name == "spotckpt.storage"]


def _transient(error: BaseException) -> bool:
    return isinstance(error, Flaky)


FAST = RetryPolicy(max_attempts=5, initial_backoff_s=0.001, max_backoff_s=0.01)


def test_retries_that_succeed_warn_once(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG, logger="spotckpt.storage")
    assert FAST.call(_failing(3), _transient, "get s3://b/k") == "ok"
    records = _records(caplog)
    warnings = [r for r in records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1
    assert "get s3://b/k failed" in warnings[0].getMessage()
    assert "retrying up to 4 more times within" in warnings[0].getMessage()
    assert [r.levelno for r in records] == [logging.WARNING, logging.DEBUG, logging.DEBUG]
    assert all("\n" not in r.getMessage() and r.exc_info is None for r in records)


def test_giving_up_is_one_line_with_attempts_and_time(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG, logger="spotckpt.storage")
    with pytest.raises(Flaky):
        FAST.call(_failing(100), _transient, "put s3://b/k")
    records = _records(caplog)
    warnings = [r.getMessage() for r in records if r.levelno >= logging.WARNING]
    assert len(warnings) == 2
    assert "retrying up to 4 more times" in warnings[0]
    assert "put s3://b/k: giving up after 5 attempts in " in warnings[1]
    assert "Flaky: try 5 failed Traceback-like second line" in warnings[1]
    assert sum(r.levelno == logging.DEBUG for r in records) == 3
    assert all("\n" not in r.getMessage() and r.exc_info is None for r in records)


def test_permanent_errors_fail_at_once_without_logs(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG, logger="spotckpt.storage")
    with pytest.raises(Flaky):
        FAST.call(_failing(1), lambda error: False, "head s3://b/k")
    assert _records(caplog) == []


def test_deadline_stops_retries_and_names_the_operation(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG, logger="spotckpt.storage")
    policy = RetryPolicy(
        max_attempts=10**6, initial_backoff_s=0.05, max_backoff_s=0.05, deadline_s=1
    )
    with pytest.raises(DeadlineExceededError, match=r"list s3://b/p: .*deadline of 1 s") as error:
        policy.call(_failing(10**9), _transient, "list s3://b/p")
    assert isinstance(error.value.__cause__, Flaky)
    warnings = [r.getMessage() for r in _records(caplog) if r.levelno >= logging.WARNING]
    assert len(warnings) == 2 and "giving up after" in warnings[1]
