"""Azurite (Microsoft's Blob Storage emulator, from npm) on loopback for the tests, and a fresh
container per test.

Its fixtures (``azurite_connection_string``, ``az_uri``) are shared with every test module by
``tests/conftest.py``. Azurite runs as a child process once per test session, in memory, on
127.0.0.1 and a free port, with ``--skipApiVersionCheck`` (azure-storage-blob 12.31 speaks a
newer service version than Azurite knows), ``--loose`` and ``--disableTelemetry`` (no test
reaches beyond loopback). It is found at ``$AZURITE_BLOB_COMMAND``,
else at ``.azurite/node_modules/.bin/azurite-blob`` (``make azurite`` installs it there), else on
the PATH; where none is installed the Azure tests are skipped with that hint.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import tempfile
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests_support import free_port

STARTUP_TIMEOUT_S = 60.0
ACCOUNT = "devstoreaccount1"
ACCOUNT_KEY = (  # Azurite's well-known development key, published in its README
    "Eby8vdM02xNOcqFlqUwJPLlmEtlCDXJ1OUzFT50uSRZ6IFsuFq2UVErCz4I6tq/K1SZFPTOtr/KBHBeksoGMGw=="
)


def azurite_command() -> str | None:
    """The azurite-blob executable, or None when it is not installed."""
    explicit = os.environ.get("AZURITE_BLOB_COMMAND")
    if explicit:
        return explicit
    local = Path(__file__).resolve().parent.parent / ".azurite/node_modules/.bin/azurite-blob"
    if local.exists():
        return str(local)
    return shutil.which("azurite-blob")


def connection_string(endpoint: str) -> str:
    """A connection string for Azurite's development account at `endpoint`."""
    return (
        f"DefaultEndpointsProtocol=http;AccountName={ACCOUNT};AccountKey={ACCOUNT_KEY};"
        f"BlobEndpoint={endpoint};"
    )


def start_azurite() -> tuple[str, subprocess.Popen[bytes], str]:
    """Start Azurite in memory; returns its account endpoint, the process and its log file."""
    command = azurite_command()
    if command is None:
        message = "Azurite is not installed: run `make azurite` (npm install azurite)"
        if os.environ.get("CI") == "true":  # CI installs it: a missing one must fail, not skip
            pytest.fail(message)
        pytest.skip(message)
    port = free_port()
    workspace = tempfile.mkdtemp(prefix="azurite-")
    log_path = os.path.join(workspace, "azurite.log")
    args = [command, "--blobHost", "127.0.0.1", "--blobPort", str(port), "--silent"]
    args += ["--skipApiVersionCheck", "--loose", "--inMemoryPersistence", "--disableTelemetry"]
    with open(log_path, "wb") as log:  # run in its own folder: it writes nothing to the checkout
        process = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, cwd=workspace)
    endpoint = f"http://127.0.0.1:{port}/{ACCOUNT}"
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while True:
        if process.poll() is not None:
            with open(log_path, encoding="utf-8", errors="replace") as log_file:
                raise RuntimeError(f"Azurite exited with {process.returncode}:\n{log_file.read()}")
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return endpoint, process, log_path
        except OSError:
            if time.monotonic() > deadline:
                stop_azurite(process)
                raise RuntimeError(f"Azurite did not listen on {port} within 60 s") from None
            time.sleep(0.05)


def stop_azurite(process: subprocess.Popen[bytes]) -> None:
    """Terminate Azurite (and kill it if it does not stop)."""
    process.terminate()
    try:
        process.wait(timeout=10)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait(timeout=10)


def create_container(endpoint: str) -> str:
    """A new, empty container on Azurite; returns its name."""
    from azure.storage.blob import BlobServiceClient

    name = f"test-{uuid.uuid4().hex[:12]}"
    with BlobServiceClient.from_connection_string(connection_string(endpoint)) as client:
        client.create_container(name)
    return name


@pytest.fixture(scope="session")
def azurite_endpoint() -> Iterator[str]:
    """The account endpoint of an Azurite server running for the whole test session."""
    endpoint, process, _ = start_azurite()
    yield endpoint
    stop_azurite(process)


@pytest.fixture
def azurite_connection_string(azurite_endpoint: str) -> str:
    """The connection string of Azurite's development account."""
    return connection_string(azurite_endpoint)


@pytest.fixture
def az_container(azurite_endpoint: str) -> str:
    """A new, empty container on Azurite."""
    return create_container(azurite_endpoint)


@pytest.fixture
def az_uri(
    az_container: str, azurite_connection_string: str, monkeypatch: pytest.MonkeyPatch
) -> str:
    """An az:// root in a fresh container; AZURE_STORAGE_CONNECTION_STRING points at Azurite,
    for child processes too."""
    monkeypatch.setenv("AZURE_STORAGE_CONNECTION_STRING", azurite_connection_string)
    return f"az://{az_container}/runs/exp1"
