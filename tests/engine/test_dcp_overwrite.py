"""DCP's habit of saving twice into one checkpoint: `dcp_writer(..., overwrite=True)` replaces a
committed step in one atomic manifest put, a reader that read the old manifest still reads the
old bytes, a fault at any store call of the re-save leaves the old step or the new one (never a
mix), gc keeps the old attempt's objects only as long as it must; DCP writers' options are
mapped or refused with what to use instead. Covers the overwrite block of docs/dcp.md."""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

HERE = Path(__file__).resolve().parent
if str(HERE.parent / "crash") not in sys.path:
    sys.path.insert(0, str(HERE.parent / "crash"))

from recorder import Fault, RecordingStore, Trace  # noqa: E402

import spotckpt  # noqa: E402
from spotckpt import CheckpointAlreadyCommittedError  # noqa: E402
from spotckpt.catalog import Catalog  # noqa: E402
from spotckpt.engine.writer import ObjectStoreWriter, WriterOptions  # noqa: E402
from spotckpt.errors import InvalidArgumentError  # noqa: E402
from spotckpt.gc import collect_garbage  # noqa: E402
from spotckpt.layout import manifest_key  # noqa: E402
from spotckpt.storage import ObjectStore, open_store  # noqa: E402
from spotckpt.storage.base import ObjectInfo  # noqa: E402
from spotckpt.verify import verify_checkpoint  # noqa: E402

from tests_support import FailingStore  # noqa: E402


def _state(value: float) -> dict[str, object]:
    return {
        "w": torch.full((300, 300), value),
        "small": {f"s{i}": torch.full((8,), value + i) for i in range(20)},
        "note": f"v{value}",
    }


def _load(uri: str, step: int | None = None) -> dict[str, object]:
    loaded = _state(0.0)
    dcp.load(loaded, storage_reader=spotckpt.dcp_reader(uri, step), no_dist=True)
    return loaded


def _value(loaded: dict[str, object]) -> float:
    """The single value a loaded state holds, failing on a mix of two saves."""
    w = loaded["w"]
    assert isinstance(w, torch.Tensor)
    value = float(w[0, 0])
    assert torch.equal(w, torch.full((300, 300), value)), "a mix of two saves"
    small = loaded["small"]
    assert isinstance(small, dict)
    assert all(torch.equal(t, torch.full((8,), value + i)) for i, t in enumerate(small.values()))
    assert loaded["note"] == f"v{value}"
    return value


def test_a_resave_replaces_the_step_and_an_earlier_reader_still_reads_the_old(
    tmp_path: Path,
) -> None:
    uri = str(tmp_path / "ck")
    dcp.save(_state(1.0), storage_writer=spotckpt.dcp_writer(uri, 5), no_dist=True)
    old_reader = spotckpt.dcp_reader(uri, 5)  # has read the old manifest
    with pytest.raises(CheckpointException) as caught:  # the default stays create-only
        dcp.save(_state(2.0), storage_writer=spotckpt.dcp_writer(uri, 5), no_dist=True)
    causes = [f[0] if isinstance(f, tuple) else f for f in caught.value.failures.values()]
    assert any(isinstance(c, CheckpointAlreadyCommittedError) for c in causes)
    dcp.save(_state(2.0), storage_writer=spotckpt.dcp_writer(uri, 5, overwrite=True), no_dist=True)
    assert _value(_load(uri)) == 2.0
    assert Catalog(open_store(uri)).steps() == [5]
    assert verify_checkpoint(open_store(uri), 5).ok
    old = _state(0.0)
    dcp.load(old, storage_reader=old_reader, no_dist=True)
    assert _value(old) == 1.0
    # gc keeps the old attempt while it is young, then lets it go; the new step stays whole.
    collect_garbage(open_store(uri))
    old_again = _state(0.0)
    dcp.load(old_again, storage_reader=spotckpt.dcp_reader(uri, 5), no_dist=True)
    assert _value(old_again) == 2.0
    report = collect_garbage(open_store(uri), safety_age_s=0.0)
    assert report.bytes_freed > 0
    assert verify_checkpoint(open_store(uri), 5).ok and _value(_load(uri)) == 2.0


def test_a_fault_at_any_call_of_a_resave_leaves_the_old_step_or_the_new(tmp_path: Path) -> None:
    base = tmp_path / "base"
    dcp.save(_state(1.0), storage_writer=spotckpt.dcp_writer(str(base), 5), no_dist=True)

    def resave(uri: str, fault: Fault | None) -> Trace:
        trace = Trace(fault)
        store = RecordingStore(open_store(uri), trace)
        writer = ObjectStoreWriter(store, 5, WriterOptions(overwrite=True))  # type: ignore[arg-type]
        try:
            dcp.save(_state(2.0), storage_writer=writer, no_dist=True)
        except BaseException:  # a simulated crash, or what the fault made the save raise
            if fault is None:
                raise
        return trace

    recorded = resave(str(_copy(base, tmp_path / "recorded")), None)
    points = [call.name for call in recorded.points()]
    assert len(points) > 5
    seen = set()
    for number, point in enumerate(points):
        for kind in ("crash", "lost", "transient"):
            root = _copy(base, tmp_path / f"r{number}-{kind}")
            resave(str(root), Fault(point, kind))
            steps = Catalog(open_store(str(root))).steps()
            assert steps == [5], f"{kind} at {point}: {steps}"
            assert verify_checkpoint(open_store(str(root)), 5).ok, f"{kind} at {point}"
            seen.add(_value(_load(str(root))))
    assert seen == {1.0, 2.0}  # some faults came before the manifest's put, some after


class _GcBeforeThePut(FailingStore):
    """A real store where, right before the overwriting manifest put, something deletes the
    objects under `gone` (a gc with a short safety age: no manifest named the new attempt's)."""

    def __init__(self, inner: ObjectStore, gone: Callable[[str], bool]) -> None:
        super().__init__(inner, fail_after_bytes=1 << 62)
        self.gone = gone
        self.fired = False

    def put(self, key: str, data: bytes, *, create_only: bool = False) -> ObjectInfo:
        if key == manifest_key(5) and not create_only and not self.fired:
            self.fired = True
            self.inner.delete_many([o.key for o in self.inner.list("step-") if self.gone(o.key)])
        return self.inner.put(key, data, create_only=create_only)


@pytest.mark.parametrize("taken", ["the new objects", "the new and the old objects"])
def test_objects_deleted_right_before_the_put_leave_the_old_step_or_none(
    tmp_path: Path, taken: str
) -> None:
    """The commit's second check finds the new objects gone: the replaced manifest is put back
    when its own objects are all there, else no manifest stays (never one over missing
    objects)."""
    uri = str(tmp_path / "ck")
    dcp.save(_state(1.0), storage_writer=spotckpt.dcp_writer(uri, 5), no_dist=True)
    old = Catalog(open_store(uri)).committed_attempt(5)
    assert old is not None

    def gone(key: str) -> bool:
        return key.endswith(".safetensors") and (taken != "the new objects" or old not in key)

    store = _GcBeforeThePut(open_store(uri), gone)
    writer = ObjectStoreWriter(store, 5, WriterOptions(overwrite=True))  # type: ignore[arg-type]
    with pytest.raises(CheckpointException, match="withdrawn right after it was written"):
        dcp.save(_state(2.0), storage_writer=writer, no_dist=True)
    assert store.fired
    if taken == "the new objects":
        assert Catalog(open_store(uri)).committed_attempt(5) == old
        assert verify_checkpoint(open_store(uri), 5).ok
        assert _value(_load(uri)) == 1.0
    else:
        assert Catalog(open_store(uri)).steps() == []


def _copy(source: Path, target: Path) -> Path:
    import shutil

    shutil.copytree(source, target)
    return target


def test_options_of_dcps_writers_are_mapped_or_refused_with_what_to_use(tmp_path: Path) -> None:
    uri = str(tmp_path / "ck")
    for name in ("single_file_per_rank", "sync_files", "_extensions"):
        with pytest.raises(InvalidArgumentError, match=f"{name}: .*leave it out|{name}: .*instead"):
            spotckpt.dcp_writer(uri, 1, **{name: True})
    with pytest.raises(InvalidArgumentError, match="thread_count must be at least 1"):
        spotckpt.dcp_writer(uri, 1, thread_count=0)
    writer = spotckpt.dcp_writer(uri, 1, thread_count=3, compression="on")
    dcp.save(_state(4.0), storage_writer=writer, no_dist=True)
    manifest = Catalog(open_store(uri)).read_manifest(1)
    assert "compressed" in manifest.features
    assert _value(_load(uri)) == 4.0
    with pytest.raises(CheckpointAlreadyCommittedError):
        Catalog(open_store(uri)).check_not_committed(1)


@pytest.mark.process
def test_thread_count_is_a_bucket_stores_concurrency(s3_uri: str) -> None:
    writer = spotckpt.dcp_writer(s3_uri, 1, thread_count=3, overwrite=True)
    assert writer.store.options.max_concurrency == 3  # type: ignore[attr-defined]
    for value in (1.0, 2.0):
        dcp.save(
            _state(value),
            storage_writer=spotckpt.dcp_writer(s3_uri, 1, overwrite=True),
            no_dist=True,
        )
    assert _value(_load(s3_uri)) == 2.0
