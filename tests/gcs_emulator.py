"""gcp-storage-emulator on loopback for the tests, and a fresh bucket per test.

Its fixtures (``gcs_endpoint``, ``gcs_uri``) are shared with every test module by
``tests/conftest.py``.

The emulator runs as a child process (``python -m gcp_storage_emulator start --in-memory``) on
127.0.0.1 and a free port, once per test session. What it cannot do (it ignores
``ifGenerationMatch``, does not paginate listings, cannot cancel a resumable session) is listed in
`EMULATOR_IGNORES_PRECONDITIONS` and covered by `tests/storage/test_gcs.py` through a faulting
proxy; create-only is also tested there against fake-gcs-server (`tests/fake_gcs.py`), which checks
``ifGenerationMatch`` on single-request uploads itself.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Iterator

import pytest
from google.auth.credentials import AnonymousCredentials
from google.cloud.storage.client import Client

from tests_support import free_port

# gcsfs (if anything imports it) would first try a gRPC bucket-type lookup that hangs for 60 s
# per call against the emulator.
os.environ.setdefault("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "false")

STARTUP_TIMEOUT_S = 30.0

EMULATOR_IGNORES_PRECONDITIONS = frozenset(
    {
        "test_create_only_put_conflicts",
        "test_create_only_streamed_conflicts_small_and_multipart",
        "test_concurrent_create_only_has_one_winner",
        "test_a_create_only_copy_never_replaces",
    }
)
"""Contract tests that need a server honouring ``ifGenerationMatch=0``; the emulator overwrites.

`tests/storage/test_gcs.py` runs their create-only and racing-writer checks on fake-gcs-server
too."""


def _wait_until_up(endpoint: str, process: subprocess.Popen[bytes], log_path: str) -> None:
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while time.monotonic() < deadline:
        if process.poll() is not None:
            with open(log_path, encoding="utf-8", errors="replace") as log:
                raise RuntimeError(
                    f"gcp-storage-emulator exited with {process.returncode}:\n{log.read()[-4000:]}"
                )
        try:
            with urllib.request.urlopen(f"{endpoint}/", timeout=1) as response:
                if response.status == 200:
                    return
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            time.sleep(0.05)
    raise RuntimeError(f"gcp-storage-emulator did not answer on {endpoint} within 30 s")


def start_emulator() -> tuple[str, subprocess.Popen[bytes], str]:
    """Start an in-memory emulator; returns its endpoint, the process and its log file."""
    port = free_port()
    endpoint = f"http://127.0.0.1:{port}"
    log_fd, log_path = tempfile.mkstemp(prefix="gcs-emulator-", suffix=".log")
    command = [sys.executable, "-m", "gcp_storage_emulator", "start", "--host", "127.0.0.1"]
    command += ["--port", str(port), "--in-memory", "--quiet"]
    with os.fdopen(log_fd, "wb") as log:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
    try:
        _wait_until_up(endpoint, process, log_path)
    except BaseException:
        stop_emulator(process)
        raise
    return endpoint, process, log_path


def stop_emulator(process: subprocess.Popen[bytes]) -> None:
    """Terminate the emulator process (and kill it if it does not stop)."""
    process.terminate()
    try:
        process.wait(timeout=10)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait(timeout=10)


def admin_client(endpoint: str) -> Client:
    """A plain google-cloud-storage client on the emulator, for looking behind the store's back."""
    return Client(
        project="test",
        credentials=AnonymousCredentials(),
        client_options={"api_endpoint": endpoint},
    )


def create_bucket(endpoint: str) -> str:
    """Create a new, empty bucket on the emulator and return its name."""
    name = f"test-{uuid.uuid4().hex[:12]}"
    client = admin_client(endpoint)
    try:
        client.create_bucket(name)
    finally:
        client.close()
    return name


@pytest.fixture(scope="session")
def gcs_endpoint() -> Iterator[str]:
    """URL of a gcp-storage-emulator on 127.0.0.1 for the whole test session."""
    endpoint, process, log_path = start_emulator()
    try:
        yield endpoint
    finally:
        stop_emulator(process)
        os.unlink(log_path)


@pytest.fixture
def gcs_uri(gcs_endpoint: str, monkeypatch: pytest.MonkeyPatch) -> str:
    """A gs:// root in a fresh bucket; STORAGE_EMULATOR_HOST points at the emulator."""
    monkeypatch.setenv("STORAGE_EMULATOR_HOST", gcs_endpoint)
    return f"gs://{create_bucket(gcs_endpoint)}/runs/exp1"
