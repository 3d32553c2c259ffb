"""What happens at and after the commit point, and the catalog's other guarantees, under faults.

- the commit point is final: lost answers, failures after the put and a coordinator killed right
  after it never undo a committed checkpoint or report "nothing was committed";
- a commit never references a missing object: one deleted or rewritten after its rank wrote it
  fails the save, and nothing is committed;
- a bad checkpoint never blocks progress: it is quarantined (bytes kept), and the step saves again;
- only canonical step folders count; retention and gc never take the newest checkpoint;
- gc judges an upload by its latest part, not by when it started;
- a restore racing retention moves on to the next candidate.
"""

from __future__ import annotations

import json
import logging
import subprocess
import time
import uuid
from collections.abc import Callable, Iterator
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import boto3
import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from spotckpt import CheckpointError, CheckpointManager, CorruptCheckpointError, SaveFailedError
from spotckpt.catalog import Catalog
from spotckpt.engine.writer import ObjectStoreWriter, WriterOptions
from spotckpt.gc import collect_garbage
from spotckpt.layout import QUARANTINE_PREFIX, manifest_key, rank_object_key, step_folder, step_key
from spotckpt.step_readings import LISTED_FROM
from spotckpt.storage import ObjectInfo, ObjectStore, RetryPolicy, StorageError, open_store

from dist_worker import launch_ranks
from fault_proxy import FaultProxy
from tests_support import SCRIPT, AfterWrite, CountingStore, FailingStore


def _state(value: float) -> dict[str, torch.Tensor]:
    return {"w": torch.full((4096,), float(value)), "b": torch.arange(16.0) + value}


def _empty() -> dict[str, torch.Tensor]:
    return {"w": torch.zeros(4096), "b": torch.zeros(16)}


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return all(torch.equal(a[k], b[k]) for k in a)


def _manager(root: str, **kwargs: Any) -> CheckpointManager:
    return CheckpointManager(root, preemption=False, **kwargs)


def _shard(root: Path, step: int) -> Path:
    return next((root / step_folder(step)).glob("a-*/*.safetensors"))


# The commit point is final ---------------------------------------------------------------------


@pytest.mark.parametrize("attempts", [1, 4], ids=["not-retried", "retried-then-412"])
def test_lost_answer_to_the_manifest_put_is_a_commit(moto_endpoint: str, attempts: int) -> None:
    """The store took the manifest but its answer never arrived: the save is committed."""
    bucket = f"lost-{uuid.uuid4().hex[:8]}"
    boto3.client("s3", endpoint_url=moto_endpoint).create_bucket(Bucket=bucket)

    def lose_first_manifest_answer(method: str, path: str) -> bool:
        return method == "PUT" and path.split("?")[0].endswith("/manifest.json") and not proxy.lost

    proxy = FaultProxy(moto_endpoint, rate=0.0, lose_answer=lose_first_manifest_answer)
    retry = RetryPolicy(max_attempts=attempts, initial_backoff_s=0.01, max_backoff_s=0.1)
    options = {"endpoint_url": proxy.endpoint, "retry": retry}
    with _manager(f"s3://{bucket}/run", storage_options=options) as mgr:
        mgr.save(1, _state(1))
        assert len(proxy.lost) == 1  # the fault really happened
        assert mgr.steps() == [1]
        target = _empty()
        assert mgr.restore(target) == 1 and _same(target, _state(1))
        assert mgr.verify(1).ok


class BreaksAfterCommit(FailingStore):
    """Once a manifest put went through, every later write, list and delete fails (disk full)."""

    def __init__(self, inner: Any) -> None:
        super().__init__(inner, 1 << 62)
        self.broken = False

    def put(self, key: str, data: bytes, *, create_only: bool = False) -> ObjectInfo:
        if self.broken:
            raise StorageError(f"put {key}: [Errno 28] No space left on device")
        info = super().put(key, data, create_only=create_only)
        self.broken = key.endswith("/manifest.json")
        return info

    def list(self, prefix: str = "") -> Iterator[ObjectInfo]:
        if self.broken:
            raise StorageError("list: connection reset")
        return super().list(prefix)

    def delete_many(self, keys: Any) -> None:
        if self.broken:
            raise StorageError("delete: connection reset")
        super().delete_many(keys)


def test_failures_after_the_commit_are_warnings(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    store = BreaksAfterCommit(open_store(str(tmp_path)))
    with _manager(str(tmp_path), store=store, keep_last=1) as mgr:  # type: ignore[arg-type]
        mgr.save(1, _state(1))
        store.broken = False
        with caplog.at_level(logging.WARNING, logger="spotckpt"):
            mgr.save(2, _state(2))  # retention fails after the commit: not an error
        assert "retention failed (the new checkpoint is committed)" in caplog.text
    with _manager(str(tmp_path)) as fresh:
        assert fresh.steps() == [1, 2]
        target = _empty()
        assert fresh.restore(target) == 2 and _same(target, _state(2))
        assert fresh.verify(2).ok


def test_coordinator_killed_right_after_the_commit(s3_uri: str, tmp_path: Path) -> None:
    """The survivor of a coordinator SIGKILLed after its manifest put reports the commit."""
    args = {"uri": s3_uri, "out": str(tmp_path), "timeout": 20}
    results = launch_ranks(2, "coordinator_dies_after_commit", args)
    assert results[0].returncode == -9
    assert results[1].returncode == 0, results[1].stdout[-3000:]
    assert (tmp_path / "result-1.txt").read_text() == "committed"
    store = open_store(s3_uri)
    manifest = Catalog(store).read_manifest(5)
    assert sorted(o.rank for o in manifest.objects.values()) == [0, 1]
    target = {"w0": torch.zeros(1 << 18), "w1": torch.zeros(1 << 18)}
    with _manager(s3_uri) as mgr:
        assert mgr.restore(target) == 5
    assert torch.equal(target["w1"], torch.full((1 << 18,), 1.0))


# A commit never references a missing object ---------------------------------------------------


def _damage(store: ObjectStore, fault: str) -> Callable[[str], None]:
    """What happens to a rank's object after it was written, behind the save's back."""
    if fault == "deleted":
        return lambda key: store.delete_many([key])
    return lambda key: store.put(key, store.get(key)[:-1])  # rewritten one byte shorter


@pytest.mark.process
@pytest.mark.parametrize("fault", ["deleted", "truncated"])
@pytest.mark.parametrize("where", ["local", "s3"])
def test_an_object_gone_before_the_commit_fails_the_save(
    where: str, fault: str, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    uri = str(tmp_path / "ckpt") if where == "local" else request.getfixturevalue("s3_uri")
    inner = open_store(uri)
    store = AfterWrite(inner, ".safetensors", _damage(inner, fault))
    with _manager(uri, store=store) as mgr:  # type: ignore[arg-type]
        with pytest.raises(SaveFailedError) as failed:
            mgr.save(1, _state(1))
        assert len(store.fired) == 1 and store.fired[0] in str(failed.value)
        assert "nothing was committed" in str(failed.value)
        assert mgr.steps() == [] and not mgr.catalog.is_committed(1)
        assert list(inner.list(f"{step_folder(1)}/")) == []  # the attempt was discarded
        mgr.save(1, _state(1))  # nothing happens behind its back this time
        target = _empty()
        assert mgr.restore(target) == 1 and _same(target, _state(1))
        assert mgr.verify(1).ok


def test_an_indexed_root_is_not_committed_over_a_missing_object(tmp_path: Path) -> None:
    inner = open_store(str(tmp_path))
    store = AfterWrite(inner, ".safetensors", _damage(inner, "deleted"))
    writer = ObjectStoreWriter(store, 1, WriterOptions(index_parts=True))  # type: ignore[arg-type]
    with pytest.raises(CheckpointException) as failed:
        dcp.save(_state(1), storage_writer=writer, planner=writer.save_planner(1), no_dist=True)
    causes = [f[0] if isinstance(f, tuple) else f for f in failed.value.failures.values()]
    assert [type(c) for c in causes] == [SaveFailedError]
    assert len(store.fired) == 1 and store.fired[0] in str(causes[0])
    assert not Catalog(inner).is_committed(1)


# A bad checkpoint never blocks progress --------------------------------------------------------


def _two_steps(root: Path) -> None:
    with _manager(str(root)) as mgr:
        mgr.save(1, _state(1))
        mgr.save(2, _state(2))


def _flip_byte(path: Path, offset: int = -10) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0xFF
    path.write_bytes(bytes(data))


def _ls_all(root: Path) -> list[dict[str, Any]]:
    done = subprocess.run(
        [str(SCRIPT), "ls", "--all", "--json", str(root)], capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr
    return list(json.loads(done.stdout)["checkpoints"])


@pytest.mark.process
@pytest.mark.parametrize("damage", ["flipped-byte", "garbage-manifest"])
def test_bad_step_is_quarantined_and_saved_again(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, damage: str
) -> None:
    _two_steps(tmp_path)
    original = (tmp_path / manifest_key(2)).read_bytes()
    if damage == "flipped-byte":
        _flip_byte(_shard(tmp_path, 2))
    else:
        original = b'{"format": "spotckpt/1", "step": 2, '  # truncated JSON
        (tmp_path / manifest_key(2)).write_bytes(original)
    with _manager(str(tmp_path)) as mgr, caplog.at_level(logging.WARNING, logger="spotckpt"):
        target = _empty()
        assert mgr.restore(target) == 1 and _same(target, _state(1))
        assert "quarantined checkpoint step 2" in caplog.text
        assert mgr.steps() == [1]
        records = list((tmp_path / step_folder(2)).glob(f"{QUARANTINE_PREFIX}*"))
        assert len(records) == 1
        assert (records[0] / "manifest.json").read_bytes() == original  # kept for inspection
        reason = json.loads((records[0] / "reason.json").read_text())
        assert reason["step"] == 2 and reason["reason"]
        quarantined = [r for r in _ls_all(tmp_path) if r["status"] == "quarantined"]
        assert [r["step"] for r in quarantined] == [2]
        mgr.save(2, _state(22))  # the step is free again: training carries on
        again = _empty()
        assert mgr.restore(again) == 2 and _same(again, _state(22))
    held = set(reason["attempts"])
    report = collect_garbage(open_store(str(tmp_path)), safety_age_s=0)
    assert all(Path(tmp_path, step_folder(2), name).is_dir() for name in held)
    assert records[0].is_dir()
    assert any("quarantined for inspection" in kept for kept in report.kept)


@pytest.mark.parametrize("damage", ["none", "flipped-byte", "garbage-manifest"])
def test_restorable_step_chooses_as_restore_does_before_anything_is_loaded(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, damage: str
) -> None:
    """For a framework that fixes its starting step first: every byte of the newest step is
    checked, and a bad one is quarantined with a warning before the older one is chosen."""
    _two_steps(tmp_path)
    if damage == "flipped-byte":
        _flip_byte(_shard(tmp_path, 2), 100)  # in a tensor's bytes, not the header
    elif damage == "garbage-manifest":
        (tmp_path / manifest_key(2)).write_bytes(b'{"format": "spotckpt/1", "step": 2, ')
    with _manager(str(tmp_path)) as mgr, caplog.at_level(logging.WARNING, logger="spotckpt"):
        if damage == "none":
            assert mgr.restorable_step() == 2
            assert mgr.steps() == [1, 2] and "quarantined" not in caplog.text
            return
        assert mgr.restorable_step() == 1
        assert "checkpoint step 2 is unusable" in caplog.text
        assert "quarantined checkpoint step 2" in caplog.text
        assert mgr.steps() == [1]
        assert len(list((tmp_path / step_folder(2)).glob(f"{QUARANTINE_PREFIX}*"))) == 1
        target = _empty()
        assert mgr.restore(target, step=1) == 1 and _same(target, _state(1))


@pytest.mark.parametrize("declared", ["spotckpt/99", "spotckpt/1+from-the-future"])
def test_unknown_format_is_skipped_not_quarantined(tmp_path: Path, declared: str) -> None:
    """A manifest from a newer spotckpt (a new layout, or a feature this one does not know) says
    nothing about the checkpoint's health."""
    _two_steps(tmp_path)
    document = json.loads((tmp_path / manifest_key(2)).read_text())
    document["format"] = declared
    (tmp_path / manifest_key(2)).write_text(json.dumps(document))
    with _manager(str(tmp_path)) as mgr:
        assert mgr.restore(_empty()) == 1
        assert mgr.steps() == [1, 2]
    assert not list((tmp_path / step_folder(2)).glob(f"{QUARANTINE_PREFIX}*"))


def test_only_checkpoint_corrupt_is_an_error_and_is_kept(tmp_path: Path) -> None:
    """With nothing older to fall back to, restore raises instead of silently starting over."""
    with _manager(str(tmp_path)) as mgr:
        mgr.save(1, _state(1))
    _flip_byte(_shard(tmp_path, 1))
    with _manager(str(tmp_path)) as mgr:
        with pytest.raises(CorruptCheckpointError, match="CRC32C mismatch"):
            mgr.restore(_empty())
        assert mgr.steps() == [1]


# Strict names; never the newest ------------------------------------------------------------------


LOOK_ALIKES = ["step-0000000003", "step-00000000\uff13", "step-000000003\n", "step-000000003 "]


@pytest.mark.process
def test_look_alikes_are_never_listed_restored_or_retired(tmp_path: Path) -> None:
    with _manager(str(tmp_path), keep_last=2) as mgr:
        for step in (1, 2, 3):
            mgr.save(step, _state(step))
        for name in LOOK_ALIKES:
            folder = tmp_path / name
            folder.mkdir()
            for item in (tmp_path / step_folder(3)).rglob("*"):
                target = folder / item.relative_to(tmp_path / step_folder(3))
                if item.is_dir():
                    target.mkdir(parents=True, exist_ok=True)
                else:
                    target.write_bytes(item.read_bytes())
        mgr.save(4, _state(4))
        assert mgr.steps() == [3, 4]
        target = _empty()
        assert mgr.restore(target) == 4 and _same(target, _state(4))
    assert all((tmp_path / name / "manifest.json").exists() for name in LOOK_ALIKES)
    ignored = {r["key"] for r in _ls_all(tmp_path) if r["status"] == "ignored"}
    assert ignored == set(LOOK_ALIKES)
    collect_garbage(open_store(str(tmp_path)), keep_last=1, safety_age_s=0)
    assert all((tmp_path / name / "manifest.json").exists() for name in LOOK_ALIKES)
    assert Catalog(open_store(str(tmp_path))).steps() == [4]


def test_the_newest_checkpoint_is_never_deleted(tmp_path: Path) -> None:
    with _manager(str(tmp_path)) as mgr:
        mgr.save(1, _state(1))
        mgr.save(2, _state(2))
        with pytest.raises(CheckpointError, match="newest committed checkpoint"):
            mgr.delete_step(2)
        with pytest.raises(CheckpointError, match="newest committed checkpoint"):
            mgr.catalog.delete_step(1, newest=1)
        assert mgr.catalog.retire(1) == [1]
        assert mgr.steps() == [2]


# gc judges activity ----------------------------------------------------------------------------


def test_gc_keeps_an_upload_that_still_receives_parts(s3_uri: str, s3_client: Any) -> None:
    bucket, prefix = s3_uri.removeprefix("s3://").split("/", 1)
    key = f"{prefix}/{step_folder(9)}/a-live/r00000-000.safetensors"
    upload = s3_client.create_multipart_upload(Bucket=bucket, Key=key)["UploadId"]
    started = s3_client.list_multipart_uploads(Bucket=bucket)["Uploads"][0]["Initiated"]
    while datetime.now(timezone.utc) < started + timedelta(seconds=2.5):
        time.sleep(0.1)  # an upload that started a while ago ...
    s3_client.upload_part(Bucket=bucket, Key=key, UploadId=upload, PartNumber=1, Body=b"x" * 1024)
    parts = s3_client.list_parts(Bucket=bucket, Key=key, UploadId=upload)["Parts"]
    latest = parts[-1]["LastModified"]  # ... and still receives parts
    assert latest - started >= timedelta(seconds=2)
    store = open_store(s3_uri)
    live = collect_garbage(store, safety_age_s=1.5, now=latest + timedelta(seconds=1))
    assert not [a for a in live.actions if a.kind == "upload"]
    assert s3_client.list_multipart_uploads(Bucket=bucket).get("Uploads")
    idle = collect_garbage(store, safety_age_s=1.5, now=latest + timedelta(seconds=5))
    assert [a.kind for a in idle.actions] == ["upload"]
    assert not s3_client.list_multipart_uploads(Bucket=bucket).get("Uploads")


# Races ------------------------------------------------------------------------------------------


class RetiresDuringRestore(FailingStore):
    """Another process's retention deletes step 3 the moment this restore touches it."""

    def __init__(self, inner: Any, when: str) -> None:
        super().__init__(inner, 1 << 62)
        self.when = when
        self.fired = False

    def _maybe_retire(self, key: str, kind: str) -> None:
        if not self.fired and kind == self.when and key.startswith(step_folder(3)):
            self.fired = True
            Catalog(self.inner).delete_step(3, newest=4)

    def head(self, key: str) -> ObjectInfo | None:
        self._maybe_retire(key, "manifest" if key.endswith("manifest.json") else "other")
        return super().head(key)

    def get_range(self, key: str, start: int, length: int) -> bytes:
        self._maybe_retire(key, "data" if key.endswith(".safetensors") else "other")
        return super().get_range(key, start, length)

    def get_range_into(self, key: str, start: int, buffer: memoryview) -> int:
        self._maybe_retire(key, "data" if key.endswith(".safetensors") else "other")
        return super().get_range_into(key, start, buffer)


@pytest.mark.parametrize("when", ["manifest", "data"])
def test_restore_racing_retention_moves_on(tmp_path: Path, when: str) -> None:
    with _manager(str(tmp_path)) as mgr:
        for step in (2, 3):
            mgr.save(step, _state(step))
    store = RetiresDuringRestore(open_store(str(tmp_path)), when)
    with _manager(str(tmp_path), store=store) as mgr:  # type: ignore[arg-type]
        target = _empty()
        assert mgr.restore(target) == 2 and _same(target, _state(2))
    assert store.fired
    assert not (tmp_path / step_folder(3)).exists()  # retired, not quarantined


@pytest.mark.parametrize("objects", [3, 40], ids=["head-each", "one-listing"])
def test_the_commit_check_names_what_is_gone_by_heads_or_one_listing(
    tmp_path: Path, objects: int
) -> None:
    """Few objects are checked with a HEAD each; many in one attempt folder with one listing."""
    inner = open_store(str(tmp_path))
    referenced = {}
    for rank in range(objects):
        key = rank_object_key("feed", rank)
        inner.put(step_key(1, key), b"x" * (rank + 1))
        referenced[key] = rank + 1
    gone = rank_object_key("feed", objects - 1)
    inner.delete_many([step_key(1, gone)])
    store = CountingStore(inner)
    with pytest.raises(SaveFailedError, match=rf"object {step_key(1, gone)} is missing"):
        Catalog(store).check_referenced(1, referenced)  # type: ignore[arg-type]
    assert store.list_requests == (0 if objects < LISTED_FROM else 1)
    del referenced[gone]
    Catalog(store).check_referenced(1, referenced)  # type: ignore[arg-type]
