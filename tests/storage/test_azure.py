"""The Azure Blob store on Azurite: create-only commits (two writers, lost answers), staged
blocks and their clean-up by gc, the credential sources, forged manifests, transient faults.

A `FaultProxy` in front of Azurite loses answers after Azurite acted, or injects 500/503/resets;
Azurite's Shared Key signatures do not cover the host, so requests pass through it unchanged.

The manager example of docs/azure.md is covered by the forged-manifest test below.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import pickle
import subprocess
import sys
import threading
import traceback
from collections.abc import Iterator
from datetime import datetime, timedelta, timezone
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from multiprocessing.reduction import ForkingPickler
from typing import Any

import pytest
import torch
from azure.storage.blob import (
    BlobServiceClient,
    ContainerSasPermissions,
    generate_container_sas,
)

from spotckpt import CheckpointManager
from spotckpt.catalog import Catalog
from spotckpt.errors import DeadlineExceededError, InvalidArgumentError
from spotckpt.format.manifest import ManifestError
from spotckpt.gc import collect_garbage
from spotckpt.layout import manifest_key
from spotckpt.storage import AlreadyExistsError, PermissionDeniedError, StorageError, open_store
from spotckpt.storage.azure import AzureStore, block_id, block_size_for
from spotckpt.storage.base import UploadInfo
from spotckpt.storage.retry import RetryPolicy
from spotckpt.verify import verify_checkpoint

from azurite import ACCOUNT, ACCOUNT_KEY, connection_string
from fault_proxy import FaultProxy

MIB = 1 << 20
RACE_TIMEOUT_S = 120.0
FAST_RETRY = RetryPolicy(max_attempts=8, initial_backoff_s=0.01, max_backoff_s=0.05)


@pytest.fixture
def service(azurite_connection_string: str) -> Iterator[BlobServiceClient]:
    """A plain SDK client on Azurite, for looking behind the store's back."""
    with BlobServiceClient.from_connection_string(azurite_connection_string) as client:
        yield client


def _proxied(proxy: FaultProxy, container: str, **options: Any) -> AzureStore:
    """An account-key store whose requests go through `proxy`."""
    store = open_store(
        f"az://{container}/runs",
        endpoint_url=f"{proxy.endpoint}/{ACCOUNT}",
        account_name=ACCOUNT,
        account_key=ACCOUNT_KEY,
        connection_string=None,
        retry=FAST_RETRY,
        **options,
    )
    assert isinstance(store, AzureStore)
    return store


@pytest.fixture
def no_env_connection_string(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("AZURE_STORAGE_CONNECTION_STRING", raising=False)


# Create-only commits ----------------------------------------------------------------------


@pytest.mark.usefixtures("no_env_connection_string")
@pytest.mark.parametrize("size", [100, 3 * MIB + 5], ids=["put-blob", "put-block-list"])
def test_lost_answer_to_own_create_only_commit_is_not_a_conflict(
    azurite_endpoint: str, az_container: str, service: BlobServiceClient, size: int
) -> None:
    # Azurite stores the blob but the answer is lost; the retry then meets 409 BlobAlreadyExists
    # for our own write, which the token in the blob's metadata tells apart from another's.
    lost: list[str] = []

    def commit_request(method: str, path: str) -> bool:
        first = method == "PUT" and ("comp=blocklist" in path or "comp=" not in path) and not lost
        if first:
            lost.append(path)
        return first

    proxy = FaultProxy(azurite_endpoint, rate=0.0, lose_answer=commit_request)
    store = _proxied(proxy, az_container, block_size=MIB)
    data = os.urandom(size)
    try:
        with store.open_writer("step-1/manifest.json", create_only=True) as writer:
            writer.write(data)
        assert proxy.lost, "the proxy lost no answer: the test proves nothing"
        assert store.get("step-1/manifest.json") == data
        # a second writer of the same name is still refused, lost answers or not
        with pytest.raises(AlreadyExistsError, match="409 BlobAlreadyExists"):
            store.put("step-1/manifest.json", b"other", create_only=True)
    finally:
        store.close()
        proxy.close()
    blob = service.get_blob_client(az_container, "runs/step-1/manifest.json")
    assert blob.download_blob().readall() == data


def test_create_only_puts_racing_from_a_barrier_have_one_winner(az_uri: str) -> None:
    writers = 6
    start = threading.Barrier(writers)
    won: list[int] = []
    lost: list[int] = []
    errors: list[BaseException] = []
    lock = threading.Lock()
    store = open_store(az_uri, max_concurrency=writers)

    def attempt(i: int) -> None:
        start.wait(timeout=RACE_TIMEOUT_S)
        try:
            with store.open_writer("step-1/manifest.json", create_only=True) as writer:
                writer.write(f"writer-{i}".encode() * (i * 40_000 + 1))
            outcome = won
        except AlreadyExistsError:
            outcome = lost
        except Exception as error:  # reported below, not lost in a thread
            with lock:
                errors.append(error)
            return
        with lock:
            outcome.append(i)

    threads = [threading.Thread(target=attempt, args=(i,)) for i in range(writers)]
    try:
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(RACE_TIMEOUT_S)
        stored = store.get("step-1/manifest.json")
    finally:
        store.close()
    assert not errors, errors
    assert len(won) == 1 and sorted(won + lost) == list(range(writers)), (won, lost)
    assert stored == f"writer-{won[0]}".encode() * (won[0] * 40_000 + 1)


def _commit_race_job(uri: str, value: float, start: Any, results: Any) -> None:
    """A job saving step 7 to `uri`; its manifest put waits at `start` for the other job's."""
    from spotckpt import CheckpointAlreadyCommittedError

    plain_put = AzureStore.put

    def put_at_the_barrier(
        store: AzureStore, key: str, data: bytes, *, create_only: bool = False
    ) -> Any:
        if create_only and key == manifest_key(7):
            start.wait(timeout=RACE_TIMEOUT_S)
        return plain_put(store, key, data, create_only=create_only)

    AzureStore.put = put_at_the_barrier  # type: ignore[method-assign]  # in this process only
    try:
        with CheckpointManager(uri, preemption=False) as manager:
            manager.save(7, {"w": torch.full((MIB,), value)})
        results.put(("committed", value, ""))
    except CheckpointAlreadyCommittedError as error:
        results.put(("refused", value, str(error)))
    except BaseException as error:
        start.abort()  # the other job must not wait for this one
        results.put(("error", value, repr(error)))


def test_two_jobs_racing_to_commit_one_step_commit_exactly_one(az_uri: str) -> None:
    context = multiprocessing.get_context("spawn")
    start = context.Barrier(2)
    results = context.Queue()
    jobs = [
        context.Process(target=_commit_race_job, args=(az_uri, value, start, results))
        for value in (1.0, 2.0)
    ]
    for job in jobs:
        job.start()
    try:
        outcomes = sorted(results.get(timeout=RACE_TIMEOUT_S) for _ in jobs)
    finally:
        for job in jobs:
            job.join(RACE_TIMEOUT_S)
            if job.is_alive():
                job.kill()
                job.join()
    assert [outcome[0] for outcome in outcomes] == ["committed", "refused"], outcomes
    winner = outcomes[0][1]
    assert "already committed" in outcomes[1][2]
    target = {"w": torch.empty(MIB)}
    with CheckpointManager(az_uri, preemption=False) as manager:
        assert manager.steps() == [7]
        assert manager.restore(target) == 7
    assert torch.equal(target["w"], torch.full((MIB,), winner))


# Staged blocks ----------------------------------------------------------------------------


def test_blocks_of_a_dead_writer_are_listed_and_discarded_by_gc(
    az_uri: str, az_container: str, service: BlobServiceClient
) -> None:
    container = service.get_container_client(az_container)
    dead = container.get_blob_client("runs/exp1/step-000000003/a-dead/data.bin")
    dead.stage_block(block_id("f" * 32, 1), b"x" * 1000)  # a writer that died before its commit
    with CheckpointManager(az_uri, preemption=False) as manager:
        manager.save(1, {"w": torch.ones(8)})
        store = manager.store
        uploads = store.list_uploads()
        assert [(u.key, u.upload_id) for u in uploads] == [
            ("step-000000003/a-dead/data.bin", "uncommitted-blocks")
        ]
        assert uploads[0].last_activity is not None
        assert not store.exists("step-000000003/a-dead/data.bin")
        report = collect_garbage(store, keep_last=5, safety_age_s=0.0, dry_run=False)
        assert any(action.kind == "upload" for action in report.actions)
        assert store.list_uploads() == []
        assert manager.steps() == [1]
    listed = [b.name for b in container.list_blobs(include=["uncommittedblobs"])]
    assert "runs/exp1/step-000000003/a-dead/data.bin" not in listed


def test_discarding_blocks_spares_a_blob_committed_meanwhile(az_uri: str) -> None:
    store = open_store(az_uri, block_size=MIB)
    try:
        store.put("obj", b"committed")
        upload = store.list_uploads()  # nothing staged
        assert upload == []
        store.abort_upload(UploadInfo("obj", "uncommitted-blocks"))  # If-None-Match: 409
        assert store.get("obj") == b"committed"
    finally:
        store.close()


def test_streaming_memory_is_bounded_by_blocks_in_flight(az_uri: str) -> None:
    store = open_store(az_uri, block_size=MIB, max_concurrency=2)
    assert isinstance(store, AzureStore)
    peak = [0]
    plain = AzureStore.stage_block

    def watching(self: AzureStore, key: str, name: str, number: int, body: bytearray) -> None:
        writer_bound = 2 * MIB  # block_size * max_concurrency
        peak[0] = max(peak[0], writer._in_flight.used)
        assert writer._in_flight.used <= writer_bound
        plain(self, key, name, number, body)

    try:
        AzureStore.stage_block = watching  # type: ignore[method-assign]
        writer = store.open_writer("big.bin")
        data = os.urandom(9 * MIB + 7)
        for start in range(0, len(data), 300_000):
            writer.write(data[start : start + 300_000])
        writer.commit()
        assert store.get("big.bin") == data
    finally:
        AzureStore.stage_block = plain  # type: ignore[method-assign]
        store.close()
    assert MIB <= peak[0] <= 2 * MIB


def test_block_sizes_grow_so_that_50000_blocks_hold_large_objects() -> None:
    assert block_size_for(1, 16 * MIB) == 16 * MIB
    assert block_size_for(4750, 16 * MIB) == 16 * MIB
    assert block_size_for(4751, 16 * MIB) == 32 * MIB
    assert block_size_for(50_000, 16 * MIB) == 4000 * MIB
    assert len({len(block_id(os.urandom(16).hex(), n)) for n in (1, 999_999)}) == 1


# Faults and deadlines ---------------------------------------------------------------------


@pytest.mark.usefixtures("no_env_connection_string")
def test_transient_faults_are_retried(azurite_endpoint: str, az_container: str) -> None:
    proxy = FaultProxy(azurite_endpoint, rate=0.3, seed=4)
    store = _proxied(proxy, az_container, block_size=MIB, max_concurrency=3)
    data = os.urandom(4 * MIB + 11)
    try:
        with store.open_writer("obj", create_only=True) as writer:
            writer.write(data)
        assert store.get("obj") == data
        buffer = bytearray(1000)
        assert store.get_range_into("obj", 3 * MIB - 500, memoryview(buffer)) == 1000
        assert bytes(buffer) == data[3 * MIB - 500 : 3 * MIB + 500]
        assert [o.key for o in store.list()] == ["obj"]
    finally:
        store.close()
        proxy.close()
    assert sum(proxy.injected.values()) > 0


@pytest.mark.usefixtures("no_env_connection_string")
def test_permanent_answers_fail_at_once(azurite_endpoint: str, az_container: str) -> None:
    proxy = FaultProxy(azurite_endpoint, rate=0.0)
    store = open_store(
        f"az://{az_container}/runs",
        endpoint_url=f"{proxy.endpoint}/{ACCOUNT}",
        account_name=ACCOUNT,
        account_key="d3Jvbmcta2V5LXdyb25nLWtleS13cm9uZy1rZXk=",
        retry=FAST_RETRY,
    )
    try:
        with pytest.raises(PermissionDeniedError) as caught:
            store.put("obj", b"x")
    finally:
        store.close()
        proxy.close()
    assert proxy.forwarded == 1  # no retry
    assert "d3Jvbmct" not in str(caught.value)


# Credentials ------------------------------------------------------------------------------


@pytest.mark.usefixtures("no_env_connection_string")
def test_a_sas_token_works_and_is_never_shown(
    azurite_endpoint: str, az_container: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    sas = generate_container_sas(
        ACCOUNT,
        az_container,
        account_key=ACCOUNT_KEY,
        permission=ContainerSasPermissions(read=True, write=True, list=True, delete=True),
        expiry=datetime.now(timezone.utc) + timedelta(hours=1),
    )
    monkeypatch.setenv("AZURE_STORAGE_SAS_TOKEN", sas)
    store = open_store(f"az://{az_container}/p", endpoint_url=azurite_endpoint)
    try:
        store.put("obj", b"through a SAS")
        assert store.get("obj") == b"through a SAS"
    finally:
        store.close()
    # a connection that fails names the request, never the signature
    dead = open_store(
        f"az://{az_container}/p",
        endpoint_url="http://127.0.0.1:9/devstoreaccount1",
        retry=RetryPolicy(max_attempts=1),
    )
    with pytest.raises(StorageError) as caught:
        dead.get("obj")
    dead.close()
    signature = next(p for p in sas.split("&") if p.startswith("sig=")).partition("=")[2]
    text = "".join(traceback.format_exception(caught.value))  # what a log would print
    assert signature not in text
    assert "Connection refused" in str(caught.value) and "/p/obj" in str(caught.value)


@pytest.mark.usefixtures("no_env_connection_string")
def test_account_key_option_and_abfs_spelling(azurite_endpoint: str, az_container: str) -> None:
    store = open_store(
        f"abfss://{az_container}@{ACCOUNT}.dfs.core.windows.net/deep/prefix",
        endpoint_url=azurite_endpoint,
        account_key=ACCOUNT_KEY,
    )
    try:
        assert store.uri == f"az://{az_container}/deep/prefix"
        assert ACCOUNT_KEY not in repr(store.options)
        store.put("k", b"v")
        assert store.get("k") == b"v"
    finally:
        store.close()
    with pytest.raises(InvalidArgumentError, match="account_name is 'other'"):
        open_store(
            f"abfs://{az_container}@{ACCOUNT}.dfs.core.windows.net/x",
            account_name="other",
            endpoint_url=azurite_endpoint,
            account_key=ACCOUNT_KEY,
        )


@pytest.mark.parametrize(
    ("uri", "match"),
    [
        ("az://Bad_Container/x", "container name"),
        ("az://user:pw@container/x", "must not carry credentials"),
        ("az://container/x?sig=abc", "must not have a query"),
        ("abfs://c@not-an-azure-host/x", "container@account.dfs.core.windows.net"),
    ],
)
def test_bad_uris_are_refused(uri: str, match: str, azurite_connection_string: str) -> None:
    with pytest.raises(InvalidArgumentError, match=match) as caught:
        open_store(uri, connection_string=azurite_connection_string)
    assert "sig=abc" not in str(caught.value) and "pw" not in str(caught.value)


def test_a_malformed_connection_string_is_not_shown() -> None:
    with pytest.raises(InvalidArgumentError, match="malformed") as caught:
        open_store("az://container/x", connection_string="AccountKey=c2VjcmV0;nonsense")
    assert "c2VjcmV0" not in str(caught.value)


def test_explicit_credentials_cross_only_into_child_processes(
    azurite_endpoint: str, az_container: str
) -> None:
    store = open_store(
        f"az://{az_container}/x", connection_string=connection_string(azurite_endpoint)
    )
    try:
        with pytest.raises(InvalidArgumentError, match="never pickled otherwise"):
            pickle.dumps(store)
        copy = pickle.loads(ForkingPickler.dumps(store))
        copy.put("k", b"v")
        assert store.get("k") == b"v"
        copy.close()
    finally:
        store.close()


# Through the checkpoint manager -----------------------------------------------------------


def test_forged_manifest_on_azure_is_refused_and_restore_falls_back(
    az_uri: str, az_container: str, service: BlobServiceClient
) -> None:
    with CheckpointManager(az_uri, preemption=False) as manager:
        manager.save(1, {"w": torch.full((64,), 1.0)})
        manager.save(2, {"w": torch.full((64,), 2.0)})
    blob = service.get_blob_client(az_container, f"runs/exp1/{manifest_key(2)}")
    document = json.loads(blob.download_blob().readall())
    document["tensors"]["w"]["shape"] = [2**62, 4]
    blob.upload_blob(json.dumps(document).encode(), overwrite=True)
    with CheckpointManager(az_uri, preemption=False) as manager:
        with pytest.raises(ManifestError, match="elements or more"):
            Catalog(manager.store).read_manifest(2)
        assert verify_checkpoint(manager.store, 2).problems
        target = {"w": torch.zeros(64)}
        assert manager.restore(target) == 1
    assert torch.equal(target["w"], torch.full((64,), 1.0))


class _Trickle:
    """A server that answers every GET with headers at once and then one byte at a time, until
    `stop` is set: a body that never trips a per-read timeout."""

    def __init__(self) -> None:
        self.stop = threading.Event()
        trickle = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def do_GET(self) -> None:
                self.send_response(206 if "Range" in self.headers else 200)
                self.send_header("Content-Length", "100000")
                self.send_header("x-ms-blob-type", "BlockBlob")
                self.end_headers()
                while not trickle.stop.wait(0.05):
                    try:
                        self.wfile.write(b"x")
                        self.wfile.flush()
                    except OSError:
                        return

            def log_message(self, *args: object) -> None:
                return None

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}/{ACCOUNT}"

    def close(self) -> None:
        self.stop.set()
        self.server.shutdown()
        self.server.server_close()


@pytest.mark.process
@pytest.mark.usefixtures("no_env_connection_string")
@pytest.mark.parametrize("read", ["get", "get_range_into"])
def test_a_trickling_answer_is_cut_at_the_deadline(read: str) -> None:
    server = _Trickle()
    store = open_store(
        "az://c0ntainer/p",
        endpoint_url=server.endpoint,
        account_name=ACCOUNT,
        account_key=ACCOUNT_KEY,
        read_timeout_s=30.0,  # per socket read: a byte every 50 ms never trips it
        retry=RetryPolicy(max_attempts=1, deadline_s=1.0),
    )
    try:
        with pytest.raises(DeadlineExceededError, match="reading the answer"):
            if read == "get":
                store.get("obj")
            else:
                store.get_range_into("obj", 0, memoryview(bytearray(100000)))
    finally:
        store.close()
        server.close()


def _spotckpt(args: list[str], env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    """The command line in a child process, with `env` over this one's."""
    code = "import sys; from spotckpt.cli import main; main(sys.argv[1:])"
    return subprocess.run(
        [sys.executable, "-c", code, *args],
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=RACE_TIMEOUT_S,
        check=False,
    )


def test_the_command_line_on_azure_and_a_wrong_key_never_printed(
    az_uri: str, azurite_endpoint: str
) -> None:
    with CheckpointManager(az_uri, preemption=False) as manager:
        manager.save(5, {"w": torch.ones(16)})
    listed = _spotckpt(["ls", az_uri], {})
    assert listed.returncode == 0, listed.stderr
    assert "5" in listed.stdout
    verified = _spotckpt(["verify", az_uri, "--step", "5"], {})
    assert verified.returncode == 0, verified.stderr
    wrong = "d3Jvbmcta2V5LXdyb25nLWtleS13cm9uZy1rZXk="
    denied = _spotckpt(
        ["-v", "ls", az_uri],
        {
            "AZURE_STORAGE_CONNECTION_STRING": connection_string(azurite_endpoint).replace(
                ACCOUNT_KEY, wrong
            )
        },
    )
    assert denied.returncode != 0
    assert wrong not in denied.stdout + denied.stderr
    assert ACCOUNT_KEY not in denied.stdout + denied.stderr


# Keys spotckpt never writes -------------------------------------------------------------------


def test_a_blob_with_an_empty_segment_stops_neither_retention_nor_gc(
    az_uri: str, az_container: str, service: BlobServiceClient
) -> None:
    """Azure accepts ``.../<attempt>//x``, which spotckpt would never write: one such blob in
    a retired step is skipped with a warning that names it, and retention and gc go on."""
    container = service.get_container_client(az_container)
    odd = "runs/exp1/step-000000001/a-odd//x"
    with CheckpointManager(az_uri, preemption=False, keep_last=1) as manager:
        manager.save(1, {"w": torch.ones(8)})
        container.upload_blob(odd, b"odd")
        manager.save(2, {"w": torch.full((8,), 2.0)})
        manager.save(3, {"w": torch.full((8,), 3.0)})
        assert manager.steps() == [3]
        store = manager.store
        listed = {
            b.name for b in container.list_blobs(name_starts_with="runs/exp1/step-000000001/")
        }
        assert listed == {odd}  # everything else of the retired step went
        store.put("step-000000002/a-left/r00000-000.safetensors", b"x")  # a failed save's
        report = collect_garbage(store, safety_age_s=0.0)
        assert [a.target for a in report.actions if a.kind == "uncommitted"] == [
            "step-000000002/a-left/"
        ]
        target = {"w": torch.empty(8)}
        assert manager.restore(target) == 3
    assert torch.equal(target["w"], torch.full((8,), 3.0))
