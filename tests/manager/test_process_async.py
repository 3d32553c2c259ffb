"""Process-mode async saves: DCP's ``AsyncCheckpointerType.PROCESS`` pickles the storage writer
through a `multiprocessing.Pipe` to a child process, where each store rebuilds itself from its URI
and options. Explicit credentials cross that pipe in memory only; pickled any other way they are
refused, and a ``memory://`` store (which lives in one process) is refused naming the fix.

The real saves run in a worker process (this file run as a script): process mode needs an
initialised process group, and DCP keeps its child alive for the life of the process.
"""

from __future__ import annotations

import contextlib
import json
import os
import pickle
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import uuid
from datetime import timedelta
from multiprocessing.reduction import ForkingPickler
from pathlib import Path
from typing import Any, cast

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

import spotckpt
from spotckpt import CheckpointManager
from spotckpt.catalog import Catalog
from spotckpt.config import ConfigError
from spotckpt.engine.reader import ObjectStoreReader
from spotckpt.errors import InvalidArgumentError
from spotckpt.storage import ObjectStore, open_store
from spotckpt.storage.base import check_portable
from spotckpt.storage.gcs import GCSStore
from spotckpt.storage.s3 import S3Store

from fault_proxy import INTERNAL, FaultProxy
from tests_support import REPO, TESTS

WORKER_TIMEOUT_S = 600.0
"""Only a guard against a hung worker: a save takes seconds."""


# Pickling in this process --------------------------------------------------------------------


def test_memory_store_is_refused_naming_the_fix(memory_uri: str) -> None:
    store = open_store(memory_uri)
    for dump in (pickle.dumps, ForkingPickler.dumps):
        with pytest.raises(InvalidArgumentError, match=r"file:// folder or an object store"):
            dump(spotckpt.dcp_writer(memory_uri, 1))
    with pytest.raises(InvalidArgumentError, match=r"lives in this process only"):
        check_portable(store)


def test_a_store_that_cannot_leave_its_process_is_named() -> None:
    class LockedStore:  # a third-party store holding a lock
        uri = "custom://bucket/run"

        def __init__(self) -> None:
            self.lock = threading.Lock()

    with pytest.raises(InvalidArgumentError, match="custom://bucket/run cannot be rebuilt"):
        check_portable(cast(ObjectStore, LockedStore()))


def test_local_store_and_writer_rebuild_from_their_root(tmp_path: Path) -> None:
    writer = spotckpt.dcp_writer(str(tmp_path / "ck"), 7)
    check_portable(writer.store)
    copy = pickle.loads(pickle.dumps(writer))
    assert copy.store.uri == writer.store.uri and copy.step == 7
    assert copy.catalog.store is copy.store
    dcp.save({"w": torch.arange(6.0)}, storage_writer=copy, no_dist=True)
    assert Catalog(open_store(str(tmp_path / "ck"))).steps() == [7]


def test_reader_pickles_as_store_and_manifest(tmp_path: Path) -> None:
    uri = str(tmp_path / "ck")
    saved = {"w": torch.randn(64, 3), "n": torch.arange(10)}
    dcp.save(saved, storage_writer=spotckpt.dcp_writer(uri, 1), no_dist=True)
    original = spotckpt.dcp_reader(uri)
    tuned = ObjectStoreReader(original.store, original.manifest, max_parallel_reads=1)
    reader = pickle.loads(pickle.dumps(tuned))
    assert isinstance(reader, ObjectStoreReader) and reader.manifest == original.manifest
    assert reader.max_parallel_reads == 1
    loaded = {"w": torch.zeros(64, 3), "n": torch.zeros(10, dtype=torch.int64)}
    dcp.load(loaded, storage_reader=reader, no_dist=True)
    assert _same_bits(saved, loaded)
    with_group = ObjectStoreReader(reader.store, reader.manifest, group=object())
    with pytest.raises(InvalidArgumentError, match="process group cannot be pickled"):
        pickle.dumps(with_group)


def test_s3_store_rebuilds_with_its_resolved_options(s3_uri: str) -> None:
    store = open_store(s3_uri, part_size=5 << 20, max_concurrency=3)
    assert isinstance(store, S3Store)
    copy = pickle.loads(pickle.dumps(store))
    assert isinstance(copy, S3Store) and copy is not store
    assert copy.uri == store.uri and copy.options == store.options
    copy.put("probe", b"made by the copy")
    assert store.get("probe") == b"made by the copy"


def test_explicit_credentials_cross_a_pipe_but_are_never_pickled_otherwise(
    s3_uri: str, moto_endpoint: str
) -> None:
    secret, token = f"secret-{uuid.uuid4().hex}", f"token-{uuid.uuid4().hex}"
    options = {"aws_access_key_id": "AKIAPROCESSTEST", "aws_secret_access_key": secret}
    store = open_store(s3_uri, endpoint_url=moto_endpoint, aws_session_token=token, **options)
    for target in (store, spotckpt.dcp_writer(s3_uri, 1, **options)):
        with pytest.raises(InvalidArgumentError, match="environment, a profile") as refused:
            pickle.dumps(target)
        assert secret not in str(refused.value) and "AKIAPROCESSTEST" not in str(refused.value)
    with pytest.raises(InvalidArgumentError):
        torch.save(store, Path(os.devnull))
    carried = ForkingPickler.loads(ForkingPickler.dumps(store))
    assert isinstance(carried, S3Store)
    assert carried.options.aws_secret_access_key == secret
    assert carried.options.aws_session_token == token
    assert carried.options.aws_access_key_id == "AKIAPROCESSTEST"
    carried.put("probe", b"x")
    assert store.get("probe") == b"x"
    assert secret not in repr(carried.options) and secret not in repr(store.__reduce__())


def test_gcs_store_keeps_the_endpoint_it_resolved(
    gcs_uri: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    store = open_store(gcs_uri)
    assert isinstance(store, GCSStore) and store.anonymous
    monkeypatch.delenv("STORAGE_EMULATOR_HOST")
    copy = pickle.loads(pickle.dumps(store))
    assert isinstance(copy, GCSStore)
    assert copy.endpoint == store.endpoint and copy.anonymous
    copy.put("probe", b"made by the copy")
    assert store.get("probe") == b"made by the copy"


# Real process-mode saves, in a worker process ------------------------------------------------


@pytest.mark.process
def test_process_mode_save_to_a_local_folder(tmp_path: Path, memory_uri: str) -> None:
    result = _run_worker(tmp_path, {"uri": str(tmp_path / "ck"), "memory_uri": memory_uri})
    _check(result)
    assert "lives in this process only" in result["memory_error"]
    assert result["memory_error_type"] == "InvalidArgumentError"


def test_process_mode_save_to_s3(tmp_path: Path, s3_uri: str) -> None:
    _check(_run_worker(tmp_path, {"uri": s3_uri, "options": {"part_size": 5 << 20}}))


def test_process_mode_save_to_gcs(tmp_path: Path, gcs_uri: str) -> None:
    _check(_run_worker(tmp_path, {"uri": gcs_uri}))


def test_process_mode_with_explicit_credentials_writes_them_nowhere(
    tmp_path: Path, s3_uri: str, moto_endpoint: str, s3_client: Any
) -> None:
    """The worker's environment has no AWS credentials, so DCP's child can only save with the
    ones carried over the pipe; afterwards no file under the test's folders (the worker's
    temporary folder, home and working folder included) and no object holds them."""
    secret, token = f"secret-{uuid.uuid4().hex}", f"token-{uuid.uuid4().hex}"
    key_id = f"AKIA{uuid.uuid4().hex[:16].upper()}"
    options = {
        "endpoint_url": moto_endpoint,
        "aws_access_key_id": key_id,
        "aws_secret_access_key": secret,
        "aws_session_token": token,
    }
    strip = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE")
    env = {k: v for k, v in os.environ.items() if k not in strip}
    env.update(
        AWS_SHARED_CREDENTIALS_FILE=str(tmp_path / "no-credentials"),
        AWS_CONFIG_FILE=str(tmp_path / "no-config"),
    )
    result = _run_worker(tmp_path, {"uri": s3_uri, "options": options}, env)
    _check(result)
    secrets = [s.encode() for s in (secret, token, key_id)]
    files = [p for p in tmp_path.rglob("*") if p.is_file() and not p.is_symlink()]
    assert files, "the worker left no files: the scan would prove nothing"
    for path in files:
        data = path.read_bytes()
        assert not any(s in data for s in secrets), f"a credential was written to {path}"
    bucket = s3_uri.removeprefix("s3://").split("/", 1)[0]
    keys = [o["Key"] for o in s3_client.list_objects_v2(Bucket=bucket).get("Contents", [])]
    assert any(k.endswith("manifest.json") for k in keys)
    for key in keys:
        body = s3_client.get_object(Bucket=bucket, Key=key)["Body"].read()
        assert not any(s in body for s in secrets), f"a credential was stored in {key}"


def test_manager_async_mode_process_saves_in_the_child_and_restores(
    tmp_path: Path, s3_uri: str
) -> None:
    result = _run_worker(tmp_path, {"uri": s3_uri, "manager": True})
    assert result["child_pid"] != result["pid"]
    assert result["steps"] == [1, 2] and result["restored"] == 2
    assert result["bit_identical"] == [True]


def test_upload_process_killed_mid_save_fails_that_save_and_the_next_save_starts_a_new_one(
    tmp_path: Path, s3_uri: str
) -> None:
    """DCP's upload process is SIGKILLed while it uploads step 2 (held at its first part by a
    proxy in front of the S3 server): that save fails with SaveFailedError naming the process,
    its attempt is discarded (no object, no open multipart upload), and step 3 is uploaded by
    a new process, committed and restored bit for bit."""
    result = _run_worker(tmp_path, {"uri": s3_uri, "kill": "mid-save"})
    assert result["failure_type"] == "SaveFailedError", result
    assert "upload process" in result["failure"] and "died" in result["failure"], result
    assert f"pid {result['killed']}" in result["failure"], result
    assert result["left_of_step_2"] == [], "the failed attempt was not discarded"
    assert result["new_child"] not in (None, result["killed"]), result
    assert result["steps"] == [1, 3] and result["restored"] == 3
    assert result["bit_identical"] == [True]


@pytest.mark.process
def test_upload_process_killed_between_saves_is_replaced_by_the_next_save(tmp_path: Path) -> None:
    """DCP's upload process is SIGKILLed while idle: the next save starts a new one and commits
    (where DCP alone would fail every later save with BrokenPipeError)."""
    result = _run_worker(tmp_path, {"uri": str(tmp_path / "ck"), "kill": "idle"})
    assert result["new_child"] not in (None, result["killed"]), result
    assert result["steps"] == [1, 2] and result["restored"] == 2
    assert result["bit_identical"] == [True]


def test_manager_async_mode_process_is_refused_where_it_cannot_work(memory_uri: str) -> None:
    with pytest.raises(ConfigError, match=r"needs torch\.distributed initialised"):
        CheckpointManager(memory_uri, async_save=True, async_mode="process", preemption=False)
    with pytest.raises(ConfigError, match='must be "thread" or "process"'):
        CheckpointManager(memory_uri, async_mode="fork", preemption=False)


def _check(result: dict[str, Any]) -> None:
    assert result["child_pid"] != result["pid"], "the save did not run in DCP's child process"
    assert result["parent_writer_untouched"], "the writer's state should stay in the child"
    assert result["steps"] == [1, 2]
    assert result["manifest_steps"] == [1, 2]
    assert result["bit_identical"] == [True, True]
    assert result["again_error_type"] == "CheckpointAlreadyCommittedError", result


def _run_worker(
    tmp_path: Path, args: dict[str, Any], env: dict[str, str] | None = None
) -> dict[str, Any]:
    """Run `_worker` with `args` in a fresh interpreter; returns what it reported."""
    out = tmp_path / "result.json"
    folders = {name: tmp_path / name for name in ("home", "cwd")}
    for folder in folders.values():
        folder.mkdir()
    # TMPDIR short: multiprocessing binds Unix sockets under it (108 bytes at most), and
    # tmp_path's length grows with pytest's run counter and the test's name.
    folders["tmp"] = Path(tempfile.mkdtemp(prefix="spa-"))
    cleanup = contextlib.ExitStack()
    cleanup.callback(shutil.rmtree, folders["tmp"], ignore_errors=True)
    environment = dict(os.environ if env is None else env)
    environment.update(
        PYTHONPATH=os.pathsep.join([str(Path(__file__).resolve().parent), str(TESTS), str(REPO)]),
        TMPDIR=str(folders["tmp"]),
        HOME=str(folders["home"]),
    )
    with cleanup:
        completed = subprocess.run(
            [sys.executable, __file__, json.dumps({**args, "out": str(out)})],
            env=environment,
            cwd=folders["cwd"],
            capture_output=True,
            text=True,
            timeout=WORKER_TIMEOUT_S,
            check=False,
        )
    output = completed.stdout + completed.stderr
    assert completed.returncode == 0, f"worker exited {completed.returncode}:\n{output[-6000:]}"
    for value in args.get("options", {}).values():
        if isinstance(value, str) and value.startswith(("secret-", "token-", "AKIA")):
            assert value not in output, "a credential appeared in the worker's output"
    result: dict[str, Any] = json.loads(out.read_text())
    return result


# The worker ----------------------------------------------------------------------------------


def _state(step: int) -> dict[str, Any]:
    """Tensors of several dtypes whose bits depend on `step` (NaNs and negative zeros too)."""
    generator = torch.Generator().manual_seed(step)
    weight = torch.randn(257, 33, generator=generator)
    weight[0, :3] = torch.tensor([float("nan"), -0.0, float("inf")])
    return {
        "model": {
            "weight": weight,
            "half": torch.randn(1000, generator=generator).to(torch.bfloat16),
            "ids": torch.randint(-(2**40), 2**40, (77,), generator=generator),
            "mask": torch.rand(31, generator=generator) > 0.5,
        },
        "big": torch.randn(6 << 20 >> 2, generator=generator),  # 6 MiB: a multipart upload on S3
    }


def _blank(step: int) -> dict[str, Any]:
    state = _state(step)
    return {
        "model": {k: torch.zeros_like(v) for k, v in state["model"].items()},
        "big": torch.zeros_like(state["big"]),
    }


def _same_bits(a: Any, b: Any) -> bool:
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same_bits(a[k], b[k]) for k in a)
    return bool(a.dtype == b.dtype and torch.equal(a.view(torch.uint8), b.view(torch.uint8)))


def _async_process_save(state: dict[str, Any], writer: Any) -> None:
    from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

    response = dcp.async_save(
        state, storage_writer=writer, async_checkpointer_type=AsyncCheckpointerType.PROCESS
    )
    upload = response.upload_completion if hasattr(response, "upload_completion") else response
    upload.result()


def _error_type(error: BaseException) -> str:
    """The spotckpt error behind a DCP failure, by class name."""
    failures = getattr(error, "failures", None)
    if failures:
        first = next(iter(failures.values()))
        return type(first[0] if isinstance(first, tuple) else first).__name__
    return type(error).__name__


def _manager_worker(args: dict[str, Any], result: dict[str, Any]) -> None:
    """Two async saves through `CheckpointManager(async_mode="process")`, then a restore."""
    from torch.distributed.checkpoint import _async_process_executor as process_executor

    mgr = CheckpointManager(
        args["uri"], async_save=True, async_mode="process", preemption=False, keep_last=None
    )
    for step in (1, 2):
        mgr.save(step, _state(step))
    mgr.wait()
    checkpoint = process_executor._CHECKPOINT_PROCESS
    result["child_pid"] = checkpoint._save_process.pid if checkpoint is not None else None
    result["steps"] = mgr.steps()
    loaded = _blank(2)
    result["restored"] = mgr.restore(loaded)
    result["bit_identical"] = [_same_bits(_state(2), loaded)]
    mgr.close()


def _upload_child() -> int:
    """The pid of DCP's upload process, found among this process's children: the one that
    multiprocessing spawned (the other one is its resource tracker)."""
    found = []
    for task in Path("/proc/self/task").iterdir():
        for pid in (task / "children").read_text().split():
            if b"spawn_main" in Path(f"/proc/{pid}/cmdline").read_bytes():
                found.append(int(pid))
    assert len(found) == 1, f"expected one upload process among the children, found {found}"
    return found[0]


def _kill(pid: int) -> None:
    """SIGKILL `pid` (a child) and wait until it is dead, leaving it for its parent to reap.

    The upload's own watcher (multiprocessing's ``is_alive``) may reap it first: then it is no
    longer our child (ChildProcessError), and dead all the same (seen on a loaded machine)."""
    os.kill(pid, signal.SIGKILL)
    with contextlib.suppress(ChildProcessError):
        os.waitid(os.P_PID, pid, os.WEXITED | os.WNOWAIT)


def _process_manager(uri: str, **storage_options: Any) -> CheckpointManager:
    return CheckpointManager(
        uri,
        async_save=True,
        async_mode="process",
        preemption=False,
        keep_last=None,
        storage_options=storage_options,
    )


def _kill_worker(args: dict[str, Any], result: dict[str, Any]) -> None:
    """Step 1 committed by DCP's upload process, which is then SIGKILLed: while idle
    (``kill="idle"``: step 2 must commit) or while it uploads step 2 (``kill="mid-save"``: step
    2 must fail, step 3 commit). The restore of the last step is compared bit for bit."""
    stalled, released = threading.Event(), threading.Event()
    armed = threading.Event()

    def hold_part_uploads(method: str, path: str) -> tuple[int, bytes] | None:
        """While armed, hold each part upload until released, then fail it."""
        if not (armed.is_set() and method == "PUT" and "partNumber=" in path):
            return None
        stalled.set()
        released.wait(WORKER_TIMEOUT_S)
        return 500, INTERNAL

    options: dict[str, Any] = {}
    if args["kill"] == "mid-save":
        proxy = FaultProxy(os.environ["AWS_ENDPOINT_URL"], rate=0.0, answer=hold_part_uploads)
        options = {"endpoint_url": proxy.endpoint, "part_size": 5 << 20}
    mgr = _process_manager(args["uri"], **options)
    mgr.save(1, _state(1))
    mgr.wait()
    result["killed"] = child = _upload_child()
    last = 2
    if args["kill"] == "idle":
        _kill(child)
    else:
        armed.set()
        mgr.save(2, _state(2))
        assert stalled.wait(WORKER_TIMEOUT_S), "the upload of step 2 never reached the store"
        armed.clear()
        _kill(child)
        released.set()
        try:
            mgr.wait()
        except BaseException as error:  # the test names what it must be
            result["failure_type"], result["failure"] = type(error).__name__, str(error)
        step_2 = "step-000000002/"
        left = [info.key for info in mgr.store.list(step_2)]
        result["left_of_step_2"] = left + [u.key for u in mgr.store.list_uploads(step_2)]
        last = 3
    mgr.save(last, _state(last))
    mgr.wait()
    result["new_child"] = _upload_child()
    result["steps"] = mgr.steps()
    loaded = _blank(last)
    result["restored"] = mgr.restore(loaded)
    result["bit_identical"] = [_same_bits(_state(last), loaded)]
    mgr.close()


def _worker(args: dict[str, Any]) -> None:
    from torch.distributed.checkpoint import _async_process_executor as process_executor

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=0, world_size=1, timeout=timedelta(seconds=120))
    uri, options = args["uri"], args.get("options", {})
    result: dict[str, Any] = {"pid": os.getpid(), "bit_identical": []}
    if args.get("manager") or args.get("kill"):
        (_kill_worker if args.get("kill") else _manager_worker)(args, result)
        Path(args["out"]).write_text(json.dumps(result))
        dist.destroy_process_group()
        return
    untouched = True
    for step in (1, 2):
        writer = spotckpt.dcp_writer(uri, step, **options)
        _async_process_save(_state(step), writer)
        untouched = untouched and writer.attempt is None and writer.manifest is None
    checkpoint = process_executor._CHECKPOINT_PROCESS
    result["child_pid"] = checkpoint._save_process.pid if checkpoint is not None else None
    result["parent_writer_untouched"] = untouched
    if "memory_uri" in args:  # refused before anything reaches the pipe, which stays usable
        try:
            _async_process_save(_state(3), spotckpt.dcp_writer(args["memory_uri"], 3))
        except BaseException as error:
            result["memory_error_type"], result["memory_error"] = _error_type(error), str(error)
    try:
        _async_process_save(_state(9), spotckpt.dcp_writer(uri, 1, **options))
        result["again_error_type"] = None
    except BaseException as error:  # DCP's CheckpointException is a BaseException
        result["again_error_type"] = _error_type(error)
    catalog = Catalog(open_store(uri, **options))
    result["steps"] = catalog.steps()
    result["manifest_steps"] = [catalog.read_manifest(s).step for s in result["steps"]]
    for step in (1, 2):
        loaded = _blank(step)
        dcp.load(loaded, storage_reader=spotckpt.dcp_reader(uri, step=step, **options))
        result["bit_identical"].append(_same_bits(_state(step), loaded))
    Path(args["out"]).write_text(json.dumps(result))
    dist.destroy_process_group()


if __name__ == "__main__":
    torch.set_num_threads(1)
    _worker(json.loads(sys.argv[1]))
