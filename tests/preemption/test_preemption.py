"""The preemption watcher against real signals and fake metadata servers on loopback."""

from __future__ import annotations

import json
import logging
import os
import signal
import socket
import struct
import threading
import time
from collections.abc import Callable
from datetime import datetime, timedelta, timezone
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest

from spotckpt import PreemptionWatcher
from spotckpt.errors import MetadataAnswerError
from spotckpt.preemption import Notice

pytestmark = pytest.mark.process  # its tests start processes or servers

Answer = tuple[int, dict[str, str], bytes]
WAIT_S = 60.0  # bound of every wait: many times what it takes even on a loaded machine
SLACK_S = 15.0  # how late a deadline may be read after the notice, on a loaded machine
HOSTILE = {"backoff_initial_s": 0.01, "backoff_max_s": 0.05, "request_timeout_s": 1.0}


class FakeMetadata:
    """A loopback HTTP server whose answers a test scripts per request.

    `respond` returns (status, headers, body), or None when it dealt with the connection itself
    (reset it, wrote bytes that are not HTTP). A responder may block on `release` to hang.
    """

    def __init__(
        self, respond: Callable[[BaseHTTPRequestHandler], Answer | None], port: int = 0
    ) -> None:
        self.requests: list[tuple[str, str, Any]] = []
        self.release = threading.Event()
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def _answer(self) -> None:
                fake.requests.append((self.command, self.path, self.headers))
                answer = respond(self)
                if answer is None:
                    self.close_connection = True
                    return
                status, headers, body = answer
                self.send_response(status)
                for name, value in headers.items():
                    self.send_header(name, value)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            do_GET = do_PUT = _answer

            def log_message(self, *args: Any) -> None:
                return None

        self.server = ThreadingHTTPServer(("127.0.0.1", port), Handler)
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    @property
    def port(self) -> int:
        return int(self.server.server_address[1])

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def close(self) -> None:
        self.release.set()
        self.server.shutdown()
        self.server.server_close()


def _reset(request: BaseHTTPRequestHandler) -> None:
    """Close the connection with a TCP reset instead of an answer."""
    request.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    request.connection.close()


def _hostile(kind: str, fake: FakeMetadata, request: BaseHTTPRequestHandler) -> Answer | None:
    """One hostile behaviour: ``500``, ``hang`` (past any timeout), ``reset``, ``not-http``."""
    if kind == "500":
        return 500, {}, b"Internal Server Error"
    if kind == "hang":
        fake.release.wait(WAIT_S)
        return None
    if kind == "reset":
        _reset(request)
        return None
    request.wfile.write(b"THIS IS NOT HTTP\r\n\r\n")
    return None


def _wait_for(predicate: Callable[[], bool], timeout: float = WAIT_S) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if predicate():
            return True
        time.sleep(0.02)
    return predicate()


def _notice(seconds: int) -> bytes:
    when = datetime.now(timezone.utc) + timedelta(seconds=seconds)
    return json.dumps({"action": "terminate", "time": when.strftime("%Y-%m-%dT%H:%M:%SZ")}).encode()


def _warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [
        r.getMessage()
        for r in caplog.records
        if r.name == "spotckpt.preemption" and r.levelno >= logging.WARNING
    ]


def test_aws_notice_with_token_refresh(
    monkeypatch: pytest.MonkeyPatch, watchers: list[PreemptionWatcher]
) -> None:
    notice = _notice(600)
    state = {"polls": 0, "tokens": 0}

    def respond(request: BaseHTTPRequestHandler) -> Answer:
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
            return 200, {}, notice
        return 404, {}, b""

    server = FakeMetadata(respond)
    monkeypatch.setenv("AWS_EC2_METADATA_SERVICE_ENDPOINT", f"http://{server.address}")
    # A generous request timeout: on a loaded machine no answer may count as a timed-out one.
    watcher = PreemptionWatcher(
        signals=(), gce=False, azure=False, poll_interval_s=0.05, request_timeout_s=30
    )
    watchers.append(watcher.start())
    try:
        assert _wait_for(lambda: watcher.preempted)
    finally:
        server.close()
    assert watcher.reason == "aws:terminate"
    assert state["tokens"] == 2
    assert watcher.deadline is not None
    assert 600 - WAIT_S < watcher.deadline - time.monotonic() <= 600
    tokens_used = [r[2].get("X-aws-ec2-metadata-token") for r in server.requests if r[0] == "GET"]
    assert tokens_used == ["token-1"] * 3 + ["token-2"] * 2


def test_aws_survives_hostile_metadata(
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    watchers: list[PreemptionWatcher],
) -> None:
    """500s, garbage, hangs, resets and non-HTTP bytes, on the token PUT and the GET alike."""
    caplog.set_level(logging.DEBUG, logger="spotckpt.preemption")
    token_script = ["500", "reset", "hang", "not-http"]
    get_script: list[str | bytes] = [
        *("500", "500"),
        b"{garbage",
        *("hang", "hang", "reset", "reset", "not-http"),
        b"[1, 2]",
        b"",  # a 404: still no notice
    ]
    notice = _notice(600)

    def respond(request: BaseHTTPRequestHandler) -> Answer | None:
        if request.command == "PUT":
            if token_script:
                return _hostile(token_script.pop(0), server, request)
            return 200, {}, b"good-token"
        if request.headers.get("X-aws-ec2-metadata-token") != "good-token":
            return 401, {}, b""
        if not get_script:
            return 200, {}, notice
        step = get_script.pop(0)
        if isinstance(step, str):
            return _hostile(step, server, request)
        return (200, {}, step) if step else (404, {}, b"Not Found")

    server = FakeMetadata(respond)
    monkeypatch.setenv("AWS_EC2_METADATA_SERVICE_ENDPOINT", f"http://{server.address}")
    watcher = PreemptionWatcher(signals=(), gce=False, azure=False, poll_interval_s=0.01, **HOSTILE)
    watchers.append(watcher.start())
    try:
        assert _wait_for(lambda: watcher.preempted)
    finally:
        server.close()
    assert not token_script and not get_script
    assert watcher.reason == "aws:terminate"  # the real notice, not the garbage before it:
    assert watcher.deadline is not None and watcher.deadline - time.monotonic() > 600 - WAIT_S
    warnings = _warnings(caplog)
    assert len(warnings) == len(set(warnings)) < 12  # once per kind of failure, not per try
    for kind in ("HTTP 500", "malformed instance-action notice", "timed out", "BadStatusLine"):
        assert sum(kind in w for w in warnings) in (1, 2), (kind, warnings)  # token and GET
    assert all("notices are off" not in r.getMessage() for r in caplog.records)


def test_gce_survives_hostile_metadata(
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    watchers: list[PreemptionWatcher],
) -> None:
    caplog.set_level(logging.DEBUG, logger="spotckpt.preemption")
    script: list[str | bytes] = [
        *("500", "500", "hang", "reset", "not-http"),
        b"maybe",
        b'{"preempted": true}',
        b"FALSE",
    ]

    def respond(request: BaseHTTPRequestHandler) -> Answer | None:
        if request.headers.get("Metadata-Flavor") != "Google":
            return 403, {}, b"missing Metadata-Flavor"
        if not script:
            return 200, {"ETag": "etag-2"}, b"TRUE"
        step = script.pop(0)
        if isinstance(step, str):
            return _hostile(step, server, request)
        return 200, {"ETag": "etag-1"}, step

    server = FakeMetadata(respond)
    monkeypatch.setenv("GCE_METADATA_HOST", server.address)
    watcher = PreemptionWatcher(signals=(), aws=False, azure=False, poll_interval_s=1, **HOSTILE)
    watchers.append(watcher.start())
    try:
        assert _wait_for(lambda: watcher.preempted)
    finally:
        server.close()
    assert not script
    assert watcher.reason == "gce:preempted"
    warnings = _warnings(caplog)
    assert len(warnings) == len(set(warnings))
    for kind in ("HTTP 500", "timed out", "BadStatusLine", "unexpected instance/preempted"):
        assert sum(kind in w for w in warnings) == 1, (kind, warnings)
    assert "last_etag=etag-1" in server.requests[-1][1]


def test_aws_malformed_notice_that_keeps_coming_is_a_notice(
    monkeypatch: pytest.MonkeyPatch, watchers: list[PreemptionWatcher]
) -> None:
    def respond(request: BaseHTTPRequestHandler) -> Answer:
        if request.command == "PUT":
            return 200, {}, b"token"
        return 200, {}, b"<html>not a notice</html>"

    server = FakeMetadata(respond)
    monkeypatch.setenv("AWS_EC2_METADATA_SERVICE_ENDPOINT", f"http://{server.address}")
    watcher = PreemptionWatcher(signals=(), gce=False, azure=False, poll_interval_s=0.01, **HOSTILE)
    watchers.append(watcher.start())
    try:
        assert _wait_for(lambda: watcher.preempted)
    finally:
        server.close()
    assert watcher.reason == "aws:terminate"
    gets = [r for r in server.requests if r[0] == "GET"]
    assert len(gets) == 3  # not taken at the first bad answer, nor ignored for ever
    assert watcher.deadline is not None and watcher.deadline - time.monotonic() <= 120


def test_service_gone_after_start_up_is_retried(
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    watchers: list[PreemptionWatcher],
) -> None:
    """Connection refused after the service has answered is an outage, not "off this cloud"."""
    caplog.set_level(logging.DEBUG, logger="spotckpt.preemption")
    first = FakeMetadata(lambda r: (200, {}, b"t") if r.command == "PUT" else (404, {}, b""))
    monkeypatch.setenv("AWS_EC2_METADATA_SERVICE_ENDPOINT", f"http://{first.address}")
    watcher = PreemptionWatcher(signals=(), gce=False, azure=False, poll_interval_s=0.01, **HOSTILE)
    watchers.append(watcher.start())
    assert _wait_for(lambda: len(first.requests) >= 3)
    first.close()
    assert _wait_for(lambda: any("ConnectionRefusedError" in w for w in _warnings(caplog)))
    notice = _notice(600)
    second = FakeMetadata(lambda r: (200, {}, b"t" if r.command == "PUT" else notice), first.port)
    try:
        assert _wait_for(lambda: watcher.preempted)
    finally:
        second.close()
    assert watcher.reason == "aws:terminate"
    assert any("answers again" in r.getMessage() for r in caplog.records)


def test_gce_notice_by_wait_for_change(
    monkeypatch: pytest.MonkeyPatch, watchers: list[PreemptionWatcher]
) -> None:
    def respond(request: BaseHTTPRequestHandler) -> Answer:
        if request.headers.get("Metadata-Flavor") != "Google":
            return 403, {}, b"missing Metadata-Flavor"
        if not request.path.startswith(
            "/computeMetadata/v1/instance/preempted?wait_for_change=true"
        ):
            return 404, {}, b""
        if "last_etag=etag-1" in request.path:
            time.sleep(0.2)  # the long poll is held until the value changes
            return 200, {"ETag": "etag-2"}, b"TRUE"
        return 200, {"ETag": "etag-1"}, b"FALSE"

    server = FakeMetadata(respond)
    monkeypatch.setenv("GCE_METADATA_HOST", server.address)
    watcher = PreemptionWatcher(signals=(), aws=False, azure=False, request_timeout_s=30)
    watchers.append(watcher.start())
    try:
        assert _wait_for(lambda: watcher.preempted)
    finally:
        server.close()
    assert watcher.reason == "gce:preempted"
    assert watcher.deadline is not None and 30 - SLACK_S < watcher.deadline - time.monotonic() <= 30
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
    for thread in watcher._threads:
        thread.join(WAIT_S)
    assert not watcher.preempted
    assert all(not t.is_alive() for t in watcher._threads)
    messages = [r.getMessage() for r in caplog.records]
    assert sum("AWS notices are off" in m for m in messages) == 1
    assert sum("GCE notices are off" in m for m in messages) == 1
    assert sum("Azure notices are off" in m for m in messages) == 1
    assert all(r.levelno <= logging.INFO for r in caplog.records)


def test_off_cloud_pollers_do_not_start(
    monkeypatch: pytest.MonkeyPatch, watchers: list[PreemptionWatcher]
) -> None:
    monkeypatch.delenv("AWS_EC2_METADATA_SERVICE_ENDPOINT", raising=False)
    monkeypatch.delenv("GCE_METADATA_HOST", raising=False)
    monkeypatch.delenv("SPOTCKPT_AZURE_METADATA_ENDPOINT", raising=False)
    monkeypatch.setattr("spotckpt.preemption.dmi._DMI", __import__("pathlib").Path("/nonexistent"))
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
        assert _wait_for(lambda: watcher.preempted)
        assert watcher.reason == "SIGUSR1" and seen == [signal.SIGUSR1]
        assert watcher.deadline is not None
        assert 20 - SLACK_S < watcher.deadline - time.monotonic() <= 20
        watcher.stop()
        os.kill(os.getpid(), signal.SIGUSR1)
        assert _wait_for(lambda: len(seen) == 2)  # the previous handler is back
    finally:
        signal.signal(signal.SIGUSR1, previous)


def test_trigger_first_notice_wins() -> None:
    watcher = PreemptionWatcher(signals=(), aws=False, azure=False, gce=False)
    watcher.trigger("scheduler", deadline=123.0)
    watcher.trigger("later", deadline=1.0)
    assert watcher.preempted and watcher.reason == "scheduler" and watcher.deadline == 123.0


def test_a_new_source_plugs_in_without_changing_the_watcher(
    caplog: pytest.LogCaptureFixture, watchers: list[PreemptionWatcher]
) -> None:
    """A cloud of one's own is one class: polled in its own thread, failures retried and logged
    like a built-in cloud's, its notice recorded."""
    caplog.set_level(logging.DEBUG, logger="spotckpt.preemption")

    class Doorbell:
        name = "Doorbell"
        where = "the front door"

        def __init__(self) -> None:
            self.rung = threading.Event()
            self.looks = 0

        def poll_once(self) -> Notice | float:
            self.looks += 1
            if self.looks == 1:
                raise MetadataAnswerError("HTTP 503")
            if self.rung.is_set():
                return Notice("doorbell", time.monotonic() + 20)
            return 0.01

    doorbell = Doorbell()
    watcher = PreemptionWatcher(
        signals=(),
        aws=False,
        gce=False,
        azure=False,
        sources=[doorbell],
        backoff_initial_s=0.01,
        backoff_max_s=0.05,
    )
    watchers.append(watcher.start())
    assert [t.name for t in watcher._threads] == ["spotckpt-doorbell"]
    assert _wait_for(lambda: doorbell.looks >= 3)
    assert not watcher.preempted
    doorbell.rung.set()
    assert _wait_for(lambda: watcher.preempted)
    assert watcher.reason == "doorbell"
    assert _wait_for(lambda: not watcher._threads[0].is_alive())  # its poller is done
    assert watcher.deadline is not None
    assert 20 - SLACK_S < watcher.deadline - time.monotonic() <= 20
    assert _warnings(caplog) == [
        "Doorbell metadata service at the front door: MetadataAnswerError: HTTP 503; retrying "
        "with back-off (at most 0.05 s) while the watcher runs"
    ]
    assert any("answers again after 1 failed tries" in r.getMessage() for r in caplog.records)
