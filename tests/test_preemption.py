"""The preemption watcher against real signals and fake metadata servers on loopback."""

from __future__ import annotations

import json
import logging
import os
import signal
import threading
import time
from collections.abc import Callable, Iterator
from datetime import datetime, timedelta, timezone
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest

from spotckpt import PreemptionWatcher


class FakeMetadata:
    """A loopback HTTP server whose answers a test scripts per path."""

    def __init__(
        self, respond: Callable[[BaseHTTPRequestHandler], tuple[int, dict[str, str], bytes]]
    ):
        self.requests: list[tuple[str, str, Any]] = []
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def _answer(self) -> None:
                fake.requests.append((self.command, self.path, self.headers))
                status, headers, body = respond(self)
                self.send_response(status)
                for name, value in headers.items():
                    self.send_header(name, value)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            do_GET = do_PUT = _answer

            def log_message(self, *args: Any) -> None:
                return None

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    @property
    def address(self) -> str:
        host, port = self.server.server_address[:2]
        return f"{host}:{port}"

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def watchers() -> Iterator[list[PreemptionWatcher]]:
    started: list[PreemptionWatcher] = []
    yield started
    for watcher in started:
        watcher.stop()


def _wait_for(predicate: Callable[[], bool], timeout: float = 10.0) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if predicate():
            return True
        time.sleep(0.02)
    return False


def test_aws_notice_with_token_refresh(
    monkeypatch: pytest.MonkeyPatch, watchers: list[PreemptionWatcher]
) -> None:
    notice_time = datetime.now(timezone.utc) + timedelta(seconds=90)
    state = {"polls": 0, "tokens": 0}

    def respond(request: BaseHTTPRequestHandler) -> tuple[int, dict[str, str], bytes]:
        if request.command == "PUT" and request.path == "/latest/api/token":
            assert request.headers["X-aws-ec2-metadata-token-ttl-seconds"]
            state["tokens"] += 1
            return 200, {}, f"token-{state['tokens']}".encode()
        if request.path == "/latest/meta-data/spot/instance-action":
            state["polls"] += 1
            token = request.headers.get("X-aws-ec2-metadata-token")
            if state["polls"] == 3 and token == "token-1":
                return 401, {}, b""  # the token expired: the watcher must fetch a new one
            if state["polls"] < 5:
                return 404, {}, b"Not Found"
            body = {"action": "terminate", "time": notice_time.strftime("%Y-%m-%dT%H:%M:%SZ")}
            return 200, {}, json.dumps(body).encode()
        return 404, {}, b""

    server = FakeMetadata(respond)
    monkeypatch.setenv("AWS_EC2_METADATA_SERVICE_ENDPOINT", f"http://{server.address}")
    watcher = PreemptionWatcher(signals=(), gce=False, poll_interval_s=0.05)
    watchers.append(watcher.start())
    try:
        assert _wait_for(lambda: watcher.preempted)
    finally:
        server.close()
    assert watcher.reason == "aws:terminate"
    assert state["tokens"] == 2
    assert watcher.deadline is not None
    assert 80 < watcher.deadline - time.monotonic() <= 91
    tokens_used = [r[2].get("X-aws-ec2-metadata-token") for r in server.requests if r[0] == "GET"]
    assert tokens_used[-1] == "token-2"


def test_gce_notice_by_wait_for_change(
    monkeypatch: pytest.MonkeyPatch, watchers: list[PreemptionWatcher]
) -> None:
    def respond(request: BaseHTTPRequestHandler) -> tuple[int, dict[str, str], bytes]:
        if request.headers.get("Metadata-Flavor") != "Google":
            return 403, {}, b"missing Metadata-Flavor"
        if not request.path.startswith(
            "/computeMetadata/v1/instance/preempted?wait_for_change=true"
        ):
            return 404, {}, b""
        if "last_etag=etag-1" in request.path:
            time.sleep(0.2)  # the long poll returns when the value changes
            return 200, {"ETag": "etag-2"}, b"TRUE"
        return 200, {"ETag": "etag-1"}, b"FALSE"

    server = FakeMetadata(respond)
    monkeypatch.setenv("GCE_METADATA_HOST", server.address)
    watcher = PreemptionWatcher(signals=(), aws=False)
    watchers.append(watcher.start())
    try:
        assert _wait_for(lambda: watcher.preempted)
    finally:
        server.close()
    assert watcher.reason == "gce:preempted"
    assert watcher.deadline is not None and 25 < watcher.deadline - time.monotonic() <= 30
    assert len(server.requests) == 2


def test_no_metadata_service_is_quiet(
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    watchers: list[PreemptionWatcher],
) -> None:
    monkeypatch.setenv("AWS_EC2_METADATA_SERVICE_ENDPOINT", "http://127.0.0.1:9")
    monkeypatch.setenv("GCE_METADATA_HOST", "127.0.0.1:9")
    caplog.set_level(logging.DEBUG, logger="spotckpt")
    watcher = PreemptionWatcher(signals=(), poll_interval_s=0.01)
    watchers.append(watcher.start())
    time.sleep(0.5)
    assert not watcher.preempted
    assert all(not t.is_alive() for t in watcher._threads)
    messages = [r.getMessage() for r in caplog.records]
    assert sum("AWS notices are off" in m for m in messages) == 1
    assert sum("GCE notices are off" in m for m in messages) == 1
    assert all(r.levelno <= logging.INFO for r in caplog.records)


def test_off_cloud_pollers_do_not_start(
    monkeypatch: pytest.MonkeyPatch, watchers: list[PreemptionWatcher]
) -> None:
    monkeypatch.delenv("AWS_EC2_METADATA_SERVICE_ENDPOINT")
    monkeypatch.delenv("GCE_METADATA_HOST")
    monkeypatch.setattr("spotckpt.preemption._DMI", __import__("pathlib").Path("/nonexistent"))
    watcher = PreemptionWatcher(signals=())
    watchers.append(watcher.start())
    assert watcher._threads == []


def test_signals_are_recorded_and_chained(watchers: list[PreemptionWatcher]) -> None:
    seen: list[int] = []
    previous = signal.signal(signal.SIGUSR1, lambda signum, frame: seen.append(signum))
    try:
        watcher = PreemptionWatcher(
            signals=(signal.SIGUSR1,), aws=False, gce=False, signal_budget_s=20
        )
        watchers.append(watcher.start())
        os.kill(os.getpid(), signal.SIGUSR1)
        assert _wait_for(lambda: watcher.preempted, 2)
        assert watcher.reason == "SIGUSR1" and seen == [signal.SIGUSR1]
        assert watcher.deadline is not None and 15 < watcher.deadline - time.monotonic() <= 20
        watcher.stop()
        os.kill(os.getpid(), signal.SIGUSR1)
        assert _wait_for(lambda: len(seen) == 2, 2)  # the previous handler is back
    finally:
        signal.signal(signal.SIGUSR1, previous)


def test_trigger_first_notice_wins() -> None:
    watcher = PreemptionWatcher(signals=(), aws=False, gce=False)
    watcher.trigger("scheduler", deadline=123.0)
    watcher.trigger("later", deadline=1.0)
    assert watcher.preempted and watcher.reason == "scheduler" and watcher.deadline == 123.0
