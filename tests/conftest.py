"""Shared fixtures: a moto S3 server over HTTP on loopback and a fresh bucket per test, the two GCS
fakes (gcp-storage-emulator and fake-gcs-server, both local processes), a memory store, and a
small real disk; Azurite (tests/azurite.py) for Azure."""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import boto3
import pytest
from moto.server import ThreadedMotoServer

import suite_guard
from azurite import (  # noqa: F401 (fixtures, shared from here)
    az_container,
    az_uri,
    azurite_connection_string,
    azurite_endpoint,
)
from fake_gcs import fake_gcs_endpoint  # noqa: F401 (a fixture, shared from here)
from gcs_emulator import gcs_endpoint, gcs_uri  # noqa: F401 (fixtures, shared from here)

# Fake credentials for the loopback server only; nothing here can reach AWS.
os.environ.setdefault("AWS_ACCESS_KEY_ID", "testing")
os.environ.setdefault("AWS_SECRET_ACCESS_KEY", "testing")
os.environ.setdefault("AWS_DEFAULT_REGION", "us-east-1")
os.environ.pop("AWS_PROFILE", None)


def start_moto() -> tuple[str, ThreadedMotoServer]:
    """Start a moto S3 server on 127.0.0.1 and a free port; returns its URL and the server."""
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    return f"http://{host}:{port}", server


@pytest.fixture(scope="session")
def moto_endpoint() -> Iterator[str]:
    """URL of a moto S3 server running on 127.0.0.1 for the whole test session."""
    endpoint, server = start_moto()
    yield endpoint
    server.stop()


@pytest.fixture
def s3_client(moto_endpoint: str):  # type: ignore[no-untyped-def]
    """A plain boto3 client on the moto server, for looking behind spotckpt's back."""
    return boto3.client("s3", endpoint_url=moto_endpoint, region_name="us-east-1")


@pytest.fixture
def s3_bucket(s3_client) -> str:  # type: ignore[no-untyped-def]
    """A new, empty bucket on the moto server."""
    name = f"test-{uuid.uuid4().hex[:12]}"
    s3_client.create_bucket(Bucket=name)
    return name


@pytest.fixture
def s3_uri(s3_bucket: str, moto_endpoint: str, monkeypatch: pytest.MonkeyPatch) -> str:
    """An s3:// root in a fresh bucket; AWS_ENDPOINT_URL points at moto for child processes."""
    monkeypatch.setenv("AWS_ENDPOINT_URL", moto_endpoint)
    return f"s3://{s3_bucket}/runs/exp1"


@pytest.fixture
def memory_uri() -> Iterator[str]:
    """A fresh memory:// store, dropped after the test."""
    from spotckpt.storage.memory import drop_memory_store

    name = f"mem-{uuid.uuid4().hex[:8]}"
    yield f"memory://{name}"
    drop_memory_store(name)


# Metadata services: never reach a real address from tests. A closed loopback port makes the
# preemption pollers find "no service" at once, and botocore never looks for IMDS credentials.
os.environ.setdefault("AWS_EC2_METADATA_DISABLED", "true")
os.environ.setdefault("AWS_EC2_METADATA_SERVICE_ENDPOINT", "http://127.0.0.1:9")
os.environ.setdefault("GCE_METADATA_HOST", "127.0.0.1:9")
os.environ.setdefault("SPOTCKPT_AZURE_METADATA_ENDPOINT", "http://127.0.0.1:9")

logging.getLogger("werkzeug").setLevel(logging.WARNING)  # moto's per-request access log

_SUITE_VARIABLES = frozenset({"SPOTCKPT_AZURE_METADATA_ENDPOINT"})
"""The ``SPOTCKPT_*`` variables this file sets for every test (above)."""


@pytest.fixture(autouse=True)
def _no_spotckpt_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every test starts without the ``SPOTCKPT_*`` variables of the shell that ran pytest:
    every manager applies them under its keyword arguments (`spotckpt.config.Config.load`), so
    a stray one would change what each manager of the suite does, and in child processes too.
    A test sets its own with monkeypatch."""
    for name in [n for n in os.environ if n.startswith("SPOTCKPT_")]:
        if name not in _SUITE_VARIABLES:
            monkeypatch.delenv(name)


def pytest_sessionstart(session: pytest.Session) -> None:
    """Refuse to run where a configuration file in the working directory would configure every
    manager the suite builds (``./spotckpt.toml``, or ``[tool.spotckpt]`` in
    ``./pyproject.toml``, read by `spotckpt.config.Config.load`)."""
    from spotckpt.config import config_files

    found = config_files(Path.cwd())
    if found:
        raise pytest.UsageError(
            f"{', '.join(found)} would configure every CheckpointManager the tests build: "
            "move it away, or run pytest from another folder"
        )


def _mount_tmpfs(target: Path) -> bool:
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(target)],
        capture_output=True,
        check=False,
    )
    return done.returncode == 0


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path | None]:
    """A mounted 1 MiB tmpfs, or None where mounting is not permitted here."""
    target = tmp_path / "small"
    target.mkdir()
    if shutil.which("mount") is None or not _mount_tmpfs(target):
        yield None
        return
    try:
        yield target
    finally:
        subprocess.run(["umount", str(target)], check=True)


# pytest-xdist: the resume matrix's lines come back from the workers (resume_matrix/conftest.py
# hands them over); the controller, which loads only this conftest, prints them.
_MATRIX_LINES: list[str] = []


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node: Any, error: Any) -> None:
    _MATRIX_LINES.extend(getattr(node, "workeroutput", {}).get("resume_matrix_lines", []))


def pytest_terminal_summary(terminalreporter: Any) -> None:
    if _MATRIX_LINES:
        terminalreporter.section("resume matrix")
        for line in _MATRIX_LINES:
            terminalreporter.write_line(line)


# pytest-xdist hands out whole files (--dist loadfile) in collection order, so a long file
# collected last runs alone at the end while the other workers idle. The longest files go first
# (their summed durations under `make test` on a 2-core machine, 2026-12-03, in seconds); the
# rest keep pytest's order.
LONGEST_FIRST = (
    "integrations/test_torchtitan.py",  # 233
    "integrations/test_accelerate_recipe.py",  # 227
    "resume_matrix/test_matrix.py",  # 203
    "preemption/test_eviction.py",  # 202
    "integrations/test_lightning.py",  # 172
    "integrations/test_transformers_integration.py",  # 166
    "tiers/test_tiers.py",  # 163
    "benchmarks/test_benchmarks_smoke.py",  # 150
)


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--no-processes",
        action="store_true",
        help="fail a test that starts a process or uses a network socket (make check)",
    )


def pytest_configure(config: pytest.Config) -> None:
    suite_guard.install(config)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    suite_guard.mark_process_tests(items)
    tests = Path(__file__).parent

    def rank(item: pytest.Item) -> int:
        relative = (
            item.path.relative_to(tests).as_posix() if item.path.is_relative_to(tests) else ""
        )
        return LONGEST_FIRST.index(relative) if relative in LONGEST_FIRST else len(LONGEST_FIRST)

    items.sort(key=rank)  # stable: pytest's order within a file and among the rest
