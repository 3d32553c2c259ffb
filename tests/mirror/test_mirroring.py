"""Mirroring committed steps to a second root (`spotckpt.mirroring`): every feature that changes
what a step is made of (references into earlier steps, signatures, compression, indexed roots),
retention at the mirror, damaged and forged sources, conflicts, and a fault at every store call of
a mirror copy, after which the mirror shows only steps that restore exactly and a second run
completes the copy."""

from __future__ import annotations

import itertools
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

HERE = Path(__file__).resolve().parent
for _folder in (HERE.parent / "crash", HERE.parent / "seams"):
    if str(_folder) not in sys.path:
        sys.path.insert(0, str(_folder))

import seam_run  # noqa: E402
from recorder import Fault, RecordingStore, SimulatedCrash, Trace  # noqa: E402

from spotckpt import CheckpointManager  # noqa: E402
from spotckpt.catalog import Catalog  # noqa: E402
from spotckpt.errors import (  # noqa: E402
    CheckpointError,
    CorruptCheckpointError,
    MirrorConflictError,
)
from spotckpt.format.signing import Keyring  # noqa: E402
from spotckpt.layout import manifest_key, step_folder  # noqa: E402
from spotckpt.mirroring import BandwidthLimit, Mirror, Pause  # noqa: E402
from spotckpt.storage import ObjectStore, open_store  # noqa: E402
from spotckpt.verify import verify_checkpoint  # noqa: E402

from tests_support import corrupt_keeping_crc32c, write_signing_key  # noqa: E402

FEATURES = ("incremental", "signed", "compressed", "indexed")


@dataclass(frozen=True)
class Features:
    incremental: bool = False
    signed: bool = False
    compressed: bool = False
    indexed: bool = False

    @property
    def id(self) -> str:
        return "+".join(name for name in FEATURES if getattr(self, name)) or "plain"


ALL = [Features(*flags) for flags in itertools.product((False, True), repeat=len(FEATURES))]


@dataclass
class Roots:
    """A source root with saved steps, and where its mirror goes."""

    source: str
    key: Path
    features: Features
    tmp: Path

    def settings(self, **extra: Any) -> dict[str, Any]:
        chosen: dict[str, Any] = {"preemption": False, "keep_last": None}
        if self.features.incremental:
            chosen["incremental"] = True
        if self.features.signed:
            chosen["signing_key"] = str(self.key)
        if self.features.compressed:
            chosen["compression"] = "on"
        return {**chosen, **extra}

    def keyring(self) -> Keyring | None:
        return Keyring.from_files(str(self.key)) if self.features.signed else None

    def catalog(self, uri_or_store: str | ObjectStore) -> Catalog:
        store = open_store(uri_or_store) if isinstance(uri_or_store, str) else uri_or_store
        return Catalog(store, self.keyring())

    def save(self, steps: tuple[int, ...], monkeypatch: pytest.MonkeyPatch) -> None:
        if self.features.indexed:
            import spotckpt.engine.writer

            monkeypatch.setattr(spotckpt.engine.writer, "INDEX_MIN_RANKS", 1)
        manager = CheckpointManager(self.source, **self.settings())
        try:
            for step in steps:
                manager.save(step, seam_run.state(step))
                manager.wait()
        finally:
            manager.close()


def _roots(tmp_path: Path, features: Features) -> Roots:
    tmp_path.mkdir(parents=True, exist_ok=True)
    key = write_signing_key(tmp_path / "key")
    return Roots(str(tmp_path / "source"), key, features, tmp_path)


def assert_mirror_sound(roots: Roots, uri: str, expected: list[int] | None = None) -> list[int]:
    """Every committed step of the mirror verifies, and its newest restores bit for bit;
    returns the committed steps."""
    catalog = roots.catalog(uri)
    steps = catalog.steps()
    if expected is not None:
        assert steps == expected
    for step in steps:
        report = verify_checkpoint(catalog.store, step, keyring=roots.keyring())
        assert report.ok, (step, report.to_dict())
    if steps:
        manager = CheckpointManager(uri, **roots.settings())
        try:
            target = seam_run.blank()
            assert manager.restore(target) == steps[-1]
            assert seam_run.same(target, seam_run.state(steps[-1]))
        finally:
            manager.close()
    return steps


@pytest.mark.parametrize("features", ALL, ids=lambda f: f.id)
def test_every_step_mirrors_and_restores_at_the_mirror(
    tmp_path: Path, features: Features, monkeypatch: pytest.MonkeyPatch
) -> None:
    roots = _roots(tmp_path, features)
    roots.save((1, 2, 3), monkeypatch)
    mirror_uri = str(tmp_path / "mirror")
    mirror = Mirror(roots.catalog(roots.source), roots.catalog(mirror_uri))
    report = mirror.catch_up()
    assert [c.step for c in report.copied] == [1, 2, 3] and not report.failed
    assert report.steps_behind == 0 and report.copied_bytes > 0
    assert_mirror_sound(roots, mirror_uri, [1, 2, 3])
    assert roots.catalog(mirror_uri).job() == roots.catalog(roots.source).job()
    if features.incremental and not features.indexed:  # the frozen tensor went once, at step 1
        assert report.copied[2].copied_bytes < report.copied[0].copied_bytes

    planned = Mirror(roots.catalog(roots.source), roots.catalog(str(tmp_path / "m2"))).plan()
    assert planned.steps == [1, 2, 3] and planned.bytes == report.copied_bytes
    assert planned.objects == sum(c.copied_objects for c in report.copied)
    assert Mirror(roots.catalog(roots.source), roots.catalog(mirror_uri)).plan().bytes == 0
    again = Mirror(roots.catalog(roots.source), roots.catalog(mirror_uri)).catch_up()
    assert again.copied == [] and again.copied_bytes == 0  # nothing newer: nothing to do
    repeated = Mirror(roots.catalog(roots.source), roots.catalog(mirror_uri)).copy_step(2)
    assert repeated.already


@pytest.mark.parametrize("features", ALL, ids=lambda f: f.id)
def test_retention_at_the_mirror_keeps_what_kept_steps_reference(
    tmp_path: Path, features: Features, monkeypatch: pytest.MonkeyPatch
) -> None:
    roots = _roots(tmp_path, features)
    roots.save((1, 2), monkeypatch)
    mirror_uri = str(tmp_path / "mirror")
    Mirror(roots.catalog(roots.source), roots.catalog(mirror_uri)).catch_up(keep_last=1)
    assert roots.catalog(mirror_uri).steps() == [2]
    roots.save((3, 4), monkeypatch)
    report = Mirror(roots.catalog(roots.source), roots.catalog(mirror_uri)).catch_up(keep_last=1)
    assert [c.step for c in report.copied] == [4]  # step 3 would be retired at once
    assert report.retired == [2]
    assert_mirror_sound(roots, mirror_uri, [4])
    # The source's own retention is its business: the mirror's step 4 needs nothing from it.
    CheckpointManager(roots.source, **roots.settings()).close()
    Catalog(open_store(roots.source), roots.keyring()).retire(1)
    assert_mirror_sound(roots, mirror_uri, [4])


def test_a_damaged_source_object_is_never_committed_at_the_mirror(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    roots = _roots(tmp_path, Features())
    roots.save((1, 2), monkeypatch)
    largest = max(
        (p for p in (tmp_path / "source" / step_folder(2)).rglob("*") if p.is_file()),
        key=lambda p: p.stat().st_size,
    )
    data = bytearray(largest.read_bytes())
    data[len(data) // 2] ^= 0x40
    largest.write_bytes(bytes(data))
    mirror_uri = str(tmp_path / "mirror")
    report = Mirror(roots.catalog(roots.source), roots.catalog(mirror_uri)).catch_up()
    assert [c.step for c in report.copied] == [1]
    assert "CorruptCheckpointError" in report.failed[2] and "CRC32C" in report.failed[2]
    assert_mirror_sound(roots, mirror_uri, [1])
    mirrored = open_store(mirror_uri)
    assert not mirrored.exists(manifest_key(2))
    key = str(largest.relative_to(tmp_path / "source"))
    assert not mirrored.exists(key), "a copy that failed its check leaves nothing at its key"


def test_bytes_forged_to_keep_their_crc32c_are_caught_by_the_signed_blake3(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    roots = _roots(tmp_path, Features(signed=True))
    roots.save((1,), monkeypatch)
    largest = max(
        (p for p in (tmp_path / "source" / step_folder(1)).rglob("*.safetensors")),
        key=lambda p: p.stat().st_size,
    )
    corrupt_keeping_crc32c(largest)
    mirror_uri = str(tmp_path / "mirror")
    with pytest.raises(CorruptCheckpointError, match="BLAKE3"):
        Mirror(roots.catalog(roots.source), roots.catalog(mirror_uri)).copy_step(1)
    assert roots.catalog(mirror_uri).steps() == []


def test_a_mirror_of_another_job_or_with_another_commit_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    roots = _roots(tmp_path, Features())
    roots.save((1, 2), monkeypatch)
    other = _roots(tmp_path / "other", Features())
    other.save((2,), monkeypatch)  # another job's step 2 where the mirror goes
    with pytest.raises(MirrorConflictError, match="another manifest"):
        Mirror(roots.catalog(roots.source), roots.catalog(other.source)).copy_step(2)
    with pytest.raises(MirrorConflictError, match="belongs to job"):
        Mirror(roots.catalog(roots.source), roots.catalog(other.source)).copy_step(1)
    assert roots.catalog(other.source).steps() == [2]


def test_an_unsigned_step_is_not_mirrored_into_a_root_that_requires_signatures(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    roots = _roots(tmp_path, Features())
    roots.save((1,), monkeypatch)
    signed = _roots(tmp_path, Features(signed=True))
    mirror_uri = str(tmp_path / "mirror")
    report = Mirror(Catalog(open_store(roots.source)), signed.catalog(mirror_uri)).catch_up()
    assert "SignatureError" in report.failed[1]
    assert signed.catalog(mirror_uri).steps() == []


def test_a_bandwidth_limit_and_a_pause_hold_the_copy(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    roots = _roots(tmp_path, Features())
    roots.save((1,), monkeypatch)
    pause = Pause()
    pause.hold()
    seen: list[tuple[int, int]] = []
    mirror = Mirror(
        roots.catalog(roots.source),
        roots.catalog(str(tmp_path / "mirror")),
        piece_bytes=256 << 10,
        limit=BandwidthLimit(64 << 20),
        pause=pause,
        progress=lambda done, total: seen.append((done, total)),
    )
    import threading

    finished = threading.Event()
    worker = threading.Thread(target=lambda: (mirror.copy_step(1), finished.set()), daemon=True)
    worker.start()
    assert not finished.wait(1.0), "a held mirror must not copy"
    assert all(done == 0 for done, _ in seen)
    pause.release()
    assert finished.wait(120)
    total = seen[-1][1]
    assert seen[-1] == (total, total) and total > 1 << 20
    assert_mirror_sound(roots, str(tmp_path / "mirror"), [1])


# A fault at every store call of a mirror copy ------------------------------------------------

FAULT_FEATURES = [
    Features(),
    Features(incremental=True, signed=True),
    Features(compressed=True, indexed=True),
]


def _record(roots: Roots, mirror_uri: str, fault: Fault | None) -> tuple[Trace, str | None]:
    """Run a catch-up of the mirror with `fault` on its calls (both sides recorded)."""
    trace = Trace(fault)
    source = RecordingStore(open_store(roots.source), trace)
    target = RecordingStore(open_store(mirror_uri), trace)
    error = None
    try:
        report = Mirror(roots.catalog(source), roots.catalog(target), copies=2).catch_up()
        error = "; ".join(report.failed.values()) or None
    except SimulatedCrash as crash:
        error = f"crash: {crash}"
    except CheckpointError as failure:
        error = f"{type(failure).__name__}: {failure}"
    return trace, error


@pytest.mark.timeout(900)
@pytest.mark.parametrize("features", FAULT_FEATURES, ids=lambda f: f.id)
def test_a_fault_at_any_call_leaves_a_sound_mirror_that_a_rerun_completes(
    tmp_path: Path, features: Features, monkeypatch: pytest.MonkeyPatch
) -> None:
    roots = _roots(tmp_path, features)
    roots.save((1, 2), monkeypatch)
    recorded, error = _record(roots, str(tmp_path / "recorded"), None)
    assert error is None
    points = [call.name for call in recorded.points()]
    assert len(points) > 10
    kinds = ("crash", "lost", "transient", "denied")
    for number, (point, kind) in enumerate(itertools.product(points, kinds)):
        if kind in ("transient", "denied") and number % 3:  # a third of them: the same paths
            continue
        mirror_uri = str(tmp_path / f"m{number}")
        _trace, _error = _record(roots, mirror_uri, Fault(point, kind))
        where = f"{kind} at {point}"
        shown = assert_mirror_sound(roots, mirror_uri)
        assert set(shown) <= {1, 2}, where
        _trace, error = _record(roots, mirror_uri, None)
        assert error is None, f"{where}: the rerun failed: {error}"
        assert assert_mirror_sound(roots, mirror_uri, [1, 2]) == [1, 2], where


def test_an_unchecked_object_already_at_the_mirror_is_checked_before_it_is_kept(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What a copy killed between a server-side copy and its check leaves: an object of the
    right size that no committed step at the mirror vouches for."""
    roots = _roots(tmp_path, Features())
    roots.save((1,), monkeypatch)
    source = open_store(roots.source)
    largest = max(source.list(f"{step_folder(1)}/"), key=lambda info: info.size)
    wrong = bytearray(source.get(largest.key))
    wrong[7] ^= 1
    mirror_uri = str(tmp_path / "mirror")
    open_store(mirror_uri).put(largest.key, bytes(wrong))
    report = Mirror(roots.catalog(roots.source), roots.catalog(mirror_uri)).catch_up()
    assert not report.failed and report.copied[0].copied_objects >= 1
    assert_mirror_sound(roots, mirror_uri, [1])
