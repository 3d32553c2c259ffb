"""verify_checkpoint reports every damaged object; collect_garbage deletes only what is safe."""

from __future__ import annotations

import fcntl
import json
import os
import pty
import re
import shutil
import struct
import subprocess
import sys
import termios
import threading
import time
from collections.abc import Iterator
from dataclasses import replace
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from spotckpt import CheckpointManager, NoCheckpointError, TrainState
from spotckpt.errors import PermissionDeniedError, StoreClockError
from spotckpt.format.manifest import Manifest
from spotckpt.gc import collect_garbage
from spotckpt.layout import CLOCK_PROBE_PREFIX, manifest_key, step_folder
from spotckpt.storage import ObjectInfo, ObjectStore, open_store
from spotckpt.storage.local import TEMP_MARKER
from spotckpt.verify import verify_checkpoint

from fsdp_checkpoints import STEP, fsdp_checkpoint
from tests_support import SCRIPT, AfterWrite, FailingStore

HOUR = 3600.0


def _save_steps(uri: str, steps: list[int], **options: Any) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2))
    with CheckpointManager(uri, preemption=False, storage_options=options) as manager:
        for step in steps:
            manager.save(step, TrainState(model=model, rng=False))


def _manifest(root: Path, step: int) -> Manifest:
    return Manifest.from_json((root / manifest_key(step)).read_bytes())


@pytest.fixture
def fsdp_copy(tmp_path: Path) -> Path:
    return Path(shutil.copytree(fsdp_checkpoint(), tmp_path / "ckpt"))


# verify -----------------------------------------------------------------------------------------


class RecordingStore(FailingStore):
    """Records the reads made through it."""

    def __init__(self, inner: ObjectStore) -> None:
        super().__init__(inner, fail_after_bytes=1 << 40)
        self.gets: list[str] = []
        self.ranges: list[tuple[str, int, int]] = []

    def get(self, key: str) -> bytes:
        self.gets.append(key)
        return super().get(key)

    def get_range(self, key: str, start: int, length: int) -> bytes:
        self.ranges.append((key, start, length))
        return super().get_range(key, start, length)

    def get_range_into(self, key: str, start: int, buffer: memoryview) -> int:
        self.ranges.append((key, start, buffer.nbytes))
        return super().get_range_into(key, start, buffer)


@pytest.mark.process
def test_intact_checkpoint_is_streamed_in_pieces(fsdp_copy: Path) -> None:
    store = RecordingStore(open_store(str(fsdp_copy)))
    progress: list[tuple[int, int]] = []
    report = verify_checkpoint(
        store, STEP, piece_size=100, progress=lambda d, t: progress.append((d, t))
    )
    manifest = _manifest(fsdp_copy, STEP)
    assert report.ok and report.problems == []
    assert report.objects_checked == 4
    assert report.bytes_checked == manifest.total_bytes
    assert progress[-1] == (manifest.total_bytes, manifest.total_bytes)
    assert store.gets == []  # manifest and data only through size-checked ranged reads
    assert max(n for key, _start, n in store.ranges if not key.endswith("manifest.json")) <= 100
    assert {key for key, _s, _l in store.ranges} == {
        f"{step_folder(STEP)}/{key}" for key in manifest.objects
    } | {manifest_key(STEP)}


@pytest.mark.process
def test_every_problem_is_reported_with_its_tensors(fsdp_copy: Path) -> None:
    manifest = _manifest(fsdp_copy, STEP)
    folder = fsdp_copy / step_folder(STEP)
    by_rank = {o.rank: o.key for o in manifest.objects.values()}
    # Rank 0: one flipped byte inside model.0.weight's chunk.
    chunk = next(
        c for c in manifest.tensors["model.0.weight"].chunks if c.location.key == by_rank[0]
    )
    corrupt = folder / by_rank[0]
    data = bytearray(corrupt.read_bytes())
    data[chunk.location.offset + 3] ^= 0x40
    corrupt.write_bytes(bytes(data))
    # Rank 1: truncated. Rank 2: deleted. Rank 3: intact.
    truncated = folder / by_rank[1]
    truncated.write_bytes(truncated.read_bytes()[:-10])
    (folder / by_rank[2]).unlink()

    report = verify_checkpoint(open_store(str(fsdp_copy)), STEP, piece_size=64)
    assert not report.ok
    kinds = {p.kind: p for p in report.problems}
    assert sorted(kinds) == ["crc32c", "missing", "size"]
    assert kinds["crc32c"].key == f"{step_folder(STEP)}/{by_rank[0]}"
    assert kinds["crc32c"].tensors == ("model.0.weight",)
    assert "model.0.weight" in kinds["crc32c"].message
    assert kinds["size"].key.endswith(by_rank[1]) and "model.0.weight" in kinds["size"].tensors
    assert kinds["missing"].key.endswith(by_rank[2]) and kinds["missing"].tensors
    assert report.objects_checked == 2  # ranks 0 and 3 were read


@pytest.mark.process
def test_block_checksums_that_disagree_with_the_object_are_reported(fsdp_copy: Path) -> None:
    path = fsdp_copy / manifest_key(STEP)
    manifest = Manifest.from_json(path.read_bytes())
    record = manifest.tensors["model.2.bias"]
    first = record.chunks[0]
    location = replace(
        first.location, block_crc32c=tuple(c ^ 1 for c in first.location.block_crc32c)
    )
    chunks = (replace(first, location=location), *record.chunks[1:])
    manifest.tensors["model.2.bias"] = replace(record, chunks=chunks)
    path.write_bytes(manifest.to_json())
    report = verify_checkpoint(open_store(str(fsdp_copy)), STEP)
    assert [(p.kind, p.tensors) for p in report.problems] == [("blocks", ("model.2.bias",))]


def test_bad_and_missing_manifests(tmp_path: Path) -> None:
    root = tmp_path / "ckpt"
    _save_steps(str(root), [1])
    store = open_store(str(root))
    with pytest.raises(NoCheckpointError, match="step 2"):
        verify_checkpoint(store, 2)
    (root / manifest_key(1)).write_bytes(b'{"format": "spotckpt/1", "step": 1')
    report = verify_checkpoint(store, 1)
    assert [p.kind for p in report.problems] == ["manifest"]
    assert "not valid JSON" in report.problems[0].message


def test_verify_on_s3_finds_a_corrupt_object(s3_uri: str, s3_client: Any, s3_bucket: str) -> None:
    _save_steps(s3_uri, [3], part_size=5 << 20)
    store = open_store(s3_uri, part_size=5 << 20)
    assert verify_checkpoint(store, 3).ok
    manifest = Manifest.from_json(store.get(manifest_key(3)))
    key = f"runs/exp1/{step_folder(3)}/{next(iter(manifest.objects))}"
    body = bytearray(s3_client.get_object(Bucket=s3_bucket, Key=key)["Body"].read())
    body[-1] ^= 0xFF
    s3_client.put_object(Bucket=s3_bucket, Key=key, Body=bytes(body))
    report = verify_checkpoint(store, 3)
    assert [p.kind for p in report.problems] == ["crc32c"]
    assert report.problems[0].key == f"{step_folder(3)}/{next(iter(manifest.objects))}"


# gc ---------------------------------------------------------------------------------------------


def _age(path: Path, seconds: float) -> None:
    """Make every file under `path` (or the file) look `seconds` old."""
    when = time.time() - seconds
    files = [path] if path.is_file() else [p for p in path.rglob("*") if p.is_file()]
    for file in files:
        os.utime(file, (when, when))


def _files(root: Path) -> list[str]:
    return sorted(p.relative_to(root).as_posix() for p in root.rglob("*") if p.is_file())


def _put(root: Path, key: str, data: bytes = b"x" * 100) -> Path:
    path = root / key
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    return path


@pytest.fixture
def messy(tmp_path: Path) -> Path:
    """Committed steps 1, 2, 3 (all old) plus leftovers old and fresh."""
    root = tmp_path / "ckpt"
    _save_steps(str(root), [1, 2, 3])
    _age(root, 3 * HOUR)
    _age(_put(root, "step-000000002/a-oldfailed/r00000-000.safetensors"), 2 * HOUR)
    _put(root, "step-000000003/a-stillwriting/r00001-000.safetensors")  # fresh
    _age(_put(root, "step-000000004/a-crashed/r00000-000.safetensors"), 5 * HOUR)
    _put(root, "step-000000005/a-inflight/r00000-000.safetensors")  # fresh, uncommitted
    _age(_put(root, f"step-000000004/a-crashed/{TEMP_MARKER}r00001-000.safetensors.1"), 5 * HOUR)
    _put(root, f"step-000000005/a-inflight/{TEMP_MARKER}r00001-000.safetensors.2")
    return root


def test_dry_run_deletes_nothing(messy: Path) -> None:
    before = _files(messy)
    report = collect_garbage(open_store(str(messy)), keep_last=1, dry_run=True)
    assert _files(messy) == before
    targets = {(a.kind, a.target) for a in report.actions}
    assert targets == {
        ("retention", "step-000000001/"),
        ("retention", "step-000000002/"),
        ("uncommitted", "step-000000004/a-crashed/"),
        ("upload", f"step-000000004/a-crashed/{TEMP_MARKER}r00001-000.safetensors.1"),
    }
    assert report.dry_run and report.objects_deleted > 0


def test_gc_deletes_old_garbage_and_keeps_fresh_and_newest(messy: Path) -> None:
    store = open_store(str(messy))
    report = collect_garbage(store, keep_last=1)
    remaining = _files(messy)
    assert not any(f.startswith(("step-000000001/", "step-000000002/")) for f in remaining)
    assert not any(f.startswith("step-000000004/") for f in remaining)
    assert "step-000000003/a-stillwriting/r00001-000.safetensors" in remaining
    assert "step-000000005/a-inflight/r00000-000.safetensors" in remaining
    assert f"step-000000005/a-inflight/{TEMP_MARKER}r00001-000.safetensors.2" in remaining
    assert any("a-stillwriting" in k and "may still be writing" in k for k in report.kept)
    manager = CheckpointManager(str(messy), preemption=False)
    assert manager.steps() == [3]
    assert verify_checkpoint(store, 3).ok
    manager.close()


def test_gc_reports_progress_per_step_folder(messy: Path) -> None:
    seen: list[tuple[int, int]] = []
    collect_garbage(open_store(str(messy)), keep_last=1, progress=lambda d, t: seen.append((d, t)))
    folders = 5  # steps 1-5; then the uploads and probes count as one more
    assert seen == [(done, folders + 1) for done in range(folders + 2)]


@pytest.mark.process
def test_gc_shows_a_bar_on_a_terminal_and_none_elsewhere(messy: Path) -> None:
    """stderr on a real pseudo-terminal, read as the command runs: tqdm draws its bar there."""
    primary, secondary = pty.openpty()
    fcntl.ioctl(secondary, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 100, 0, 0))  # 100 wide
    screen: list[bytes] = []
    reader = threading.Thread(target=_drain, args=(primary, screen))
    reader.start()
    try:
        shown = subprocess.run(
            [str(SCRIPT), "gc", str(messy), "--dry-run"],
            stdout=subprocess.PIPE,
            stderr=secondary,
            text=True,
            timeout=300,
        )
    finally:
        os.close(secondary)
        reader.join()
        os.close(primary)
    drawn = b"".join(screen)
    assert shown.returncode == 0, drawn
    assert re.search(rb"gc: .*\d+(/6)?step", drawn), drawn
    assert "would delete" in shown.stdout
    piped = subprocess.run(
        [str(SCRIPT), "gc", str(messy), "--dry-run"], capture_output=True, text=True, timeout=300
    )
    assert piped.returncode == 0 and piped.stderr == ""


def _drain(fd: int, into: list[bytes]) -> None:
    """Read a terminal until its other end is closed (EIO) and it is drained."""
    while True:
        try:
            chunk = os.read(fd, 65536)
        except OSError:
            return
        if not chunk:
            return
        into.append(chunk)


def test_unreferenced_attempt_of_committed_step_goes_when_old(messy: Path) -> None:
    report = collect_garbage(open_store(str(messy)))  # no retention
    assert ("attempt", "step-000000002/a-oldfailed/") in {
        (a.kind, a.target) for a in report.actions
    }
    remaining = _files(messy)
    assert not any("a-oldfailed" in f for f in remaining)
    assert [f for f in remaining if f.endswith("manifest.json")] == [
        f"step-00000000{s}/manifest.json" for s in (1, 2, 3)
    ]
    for step in (1, 2, 3):
        assert verify_checkpoint(open_store(str(messy)), step).ok


def test_newest_checkpoint_is_never_deleted(tmp_path: Path) -> None:
    root = tmp_path / "ckpt"
    _save_steps(str(root), [5])
    _age(root, 100 * HOUR)
    before = _files(root)
    report = collect_garbage(open_store(str(root)), keep_last=1, safety_age_s=0)
    assert report.actions == [] and _files(root) == before
    with pytest.raises(ValueError, match="at least 1"):
        collect_garbage(open_store(str(root)), keep_last=0)


def test_step_with_invalid_manifest_is_left_alone(tmp_path: Path) -> None:
    root = tmp_path / "ckpt"
    _save_steps(str(root), [1])
    (root / manifest_key(1)).write_bytes(b"not json")
    _put(root, "step-000000001/a-other/r00000-000.safetensors")
    _age(root, 10 * HOUR)
    before = _files(root)
    report = collect_garbage(open_store(str(root)))
    assert _files(root) == before
    assert any("manifest cannot be read" in k for k in report.kept)


class CommitDuringGc(FailingStore):
    """Makes a manifest appear just after gc listed the root (a save committing meanwhile)."""

    def __init__(self, inner: ObjectStore, key: str) -> None:
        super().__init__(inner, fail_after_bytes=1 << 40)
        self.key = key

    def list(self, prefix: str = "") -> Iterator[ObjectInfo]:
        listed = list(self.inner.list(prefix))
        self.inner.put(self.key, b"{}")
        return iter(listed)


def test_folder_committed_while_gc_runs_survives(tmp_path: Path) -> None:
    root = tmp_path / "ckpt"
    _age(_put(root, "step-000000009/a-slow/r00000-000.safetensors"), 2 * HOUR)
    store = CommitDuringGc(open_store(str(root)), manifest_key(9))
    report = collect_garbage(store)
    assert report.actions == []
    assert (root / "step-000000009/a-slow/r00000-000.safetensors").exists()


def test_s3_old_uploads_and_attempts(s3_uri: str, s3_client: Any, s3_bucket: str) -> None:
    options = {"part_size": 5 << 20}
    _save_steps(s3_uri, [1, 2], **options)
    store = open_store(s3_uri, **options)
    s3_client.put_object(
        Bucket=s3_bucket, Key="runs/exp1/step-000000002/a-dead/r00000-000.safetensors", Body=b"z"
    )
    upload = s3_client.create_multipart_upload(
        Bucket=s3_bucket, Key="runs/exp1/step-000000003/a-dead/r00000-000.safetensors"
    )
    fresh = collect_garbage(store, keep_last=1, dry_run=True)
    # The new attempt object is too young; moto reports every upload as initiated in 2010.
    assert {a.kind for a in fresh.actions} == {"retention", "upload"}
    assert any("a-dead" in kept for kept in fresh.kept)
    later = datetime.now(timezone.utc) + timedelta(hours=2)
    report = collect_garbage(store, keep_last=1, now=later)
    assert {(a.kind, a.target) for a in report.actions} == {
        ("retention", "step-000000001/"),
        ("attempt", "step-000000002/a-dead/"),
        ("upload", "step-000000003/a-dead/r00000-000.safetensors"),
    }
    uploads = s3_client.list_multipart_uploads(Bucket=s3_bucket).get("Uploads", [])
    assert upload["UploadId"] not in {u["UploadId"] for u in uploads}
    keys = [o["Key"] for o in s3_client.list_objects_v2(Bucket=s3_bucket)["Contents"]]
    assert not any("step-000000001" in k or "a-dead" in k for k in keys)
    assert verify_checkpoint(store, 2).ok


# gc judges age by the store's clock --------------------------------------------------------------


def _faketime() -> str:
    found = shutil.which("faketime")
    assert found, "gc's clock tests run it under libfaketime: apt-get install faketime (make does)"
    return found


AHEAD = ["-f", "+2h"]
"""faketime's offset: the process's clock runs 2 h ahead. ``NO_FAKE_STAT`` (set below) keeps
file times real: a local folder's clock is the kernel's, like a bucket's is the server's."""


def _ahead(command: list[str]) -> subprocess.CompletedProcess[str]:
    """`command` in a child process whose clock runs 2 h ahead of the store's."""
    env = {**os.environ, "NO_FAKE_STAT": "1"}
    return subprocess.run(
        [_faketime(), *AHEAD, *command], env=env, capture_output=True, text=True, check=False
    )


@pytest.mark.process
@pytest.mark.parametrize("where", ["local", "s3"])
def test_gc_on_a_host_two_hours_ahead_keeps_a_live_save(
    where: str, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    """gc runs (a real child process, its clock 2 h ahead) after a rank wrote its object and
    before the save commits: the save's objects stay and the checkpoint restores."""
    uri = str(tmp_path / "ckpt") if where == "local" else request.getfixturevalue("s3_uri")
    clock = _ahead([sys.executable, "-c", "import time; print(time.time())"])
    assert float(clock.stdout) > time.time() + 1.9 * HOUR, clock.stderr  # the shift is real
    runs: list[subprocess.CompletedProcess[str]] = []
    store = AfterWrite(
        open_store(uri),
        ".safetensors",
        lambda key: runs.append(_ahead([str(SCRIPT), "gc", uri, "--json"])),
    )
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2))
    with CheckpointManager(uri, store=store, preemption=False) as manager:  # type: ignore[arg-type]
        manager.save(1, TrainState(model=model, rng=False))
    assert len(runs) == 1 and runs[0].returncode == 0, runs[0].stderr
    report = json.loads(runs[0].stdout)
    assert report["actions"] == []
    assert any("a-" in kept and "may still be writing" in kept for kept in report["kept"])
    assert verify_checkpoint(open_store(uri), 1).ok
    assert list(open_store(uri).list(CLOCK_PROBE_PREFIX)) == []  # gc deleted its probe


class NoClock(FailingStore):
    """A real store that gives gc's clock probe no usable time: it refuses to write it, or
    reports it without a time."""

    def __init__(self, inner: ObjectStore, fault: str) -> None:
        super().__init__(inner, fail_after_bytes=1 << 40)
        self.fault = fault

    def put(self, key: str, data: bytes, *, create_only: bool = False) -> ObjectInfo:
        if self.fault == "refused" and key.startswith(CLOCK_PROBE_PREFIX):
            raise PermissionDeniedError(f"put {key}: 403 Forbidden")
        return super().put(key, data, create_only=create_only)

    def head(self, key: str) -> ObjectInfo | None:
        info = super().head(key)
        if self.fault == "timeless" and info is not None:
            return replace(info, last_modified=None)
        return info


@pytest.mark.parametrize(
    ("fault", "message"),
    [("refused", "could not write its clock probe"), ("timeless", "gave its clock probe")],
)
def test_gc_refuses_to_run_without_the_store_s_time(messy: Path, fault: str, message: str) -> None:
    before = _files(messy)
    with pytest.raises(StoreClockError, match=message):
        collect_garbage(NoClock(open_store(str(messy)), fault), keep_last=1)
    assert _files(messy) == before  # nothing deleted, no probe left


def test_gc_cleans_up_its_clock_probes(messy: Path) -> None:
    stale = _put(messy, f"{CLOCK_PROBE_PREFIX}left-by-a-gc-that-died", b"")
    _age(stale, 2 * HOUR)
    fresh = _put(messy, f"{CLOCK_PROBE_PREFIX}another-gc-s", b"")
    dry = collect_garbage(open_store(str(messy)), dry_run=True)
    assert ("probe", f"{CLOCK_PROBE_PREFIX}left-by-a-gc-that-died") in {
        (a.kind, a.target) for a in dry.actions
    }
    assert stale.exists()
    collect_garbage(open_store(str(messy)))
    probes = [f for f in _files(messy) if f.startswith(CLOCK_PROBE_PREFIX)]
    assert probes == [f"{CLOCK_PROBE_PREFIX}another-gc-s"] and fresh.exists()
