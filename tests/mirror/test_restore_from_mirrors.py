"""Restart from the nearest copy: a restore looks at the job's root and every mirror, takes the
newest step that loads anywhere (signatures checked as at the root), and goes on when the root's
server is gone."""

from __future__ import annotations

import logging
import sys
from pathlib import Path
from typing import Any

import pytest

HERE = Path(__file__).resolve().parent
if str(HERE.parent / "seams") not in sys.path:
    sys.path.insert(0, str(HERE.parent / "seams"))

import seam_run  # noqa: E402

from spotckpt import CheckpointManager  # noqa: E402
from spotckpt.catalog import Catalog  # noqa: E402
from spotckpt.errors import ConfigError, NoCheckpointError, SaveFailedError  # noqa: E402
from spotckpt.layout import step_folder  # noqa: E402
from spotckpt.mirroring import Mirror  # noqa: E402
from spotckpt.storage import RetryPolicy, open_store  # noqa: E402

from fault_proxy import FaultProxy  # noqa: E402
from tests_support import write_signing_key  # noqa: E402

QUICK = RetryPolicy(max_attempts=2, initial_backoff_s=0.05, max_backoff_s=0.1, deadline_s=5.0)


def _restored(manager: CheckpointManager, step: int | None = None) -> int | None:
    state = seam_run.blank()
    got = manager.restore(state, step=step)
    if got is not None:
        assert seam_run.same(state, seam_run.state(got)), f"step {got} restored wrong"
    return got


def _save(uri: str, steps: tuple[int, ...], **settings: Any) -> None:
    with CheckpointManager(uri, preemption=False, keep_last=None, **settings) as manager:
        for step in steps:
            manager.save(step, seam_run.state(step))


@pytest.mark.process
def test_the_root_server_stopped_the_job_resumes_from_a_mirror(
    s3_bucket: str, moto_endpoint: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    proxy = FaultProxy(moto_endpoint, rate=0.0)
    primary = f"s3://{s3_bucket}/runs/exp1"
    options = {"endpoint_url": proxy.endpoint, "retry": QUICK}
    mirror = str(tmp_path / "mirror")
    _save(primary, (1, 2), storage_options=options, mirrors=[mirror])
    proxy.close()  # the primary's region is out
    with (
        caplog.at_level(logging.WARNING, logger="spotckpt"),
        CheckpointManager(
            primary, preemption=False, storage_options=options, mirrors=[mirror]
        ) as manager,
    ):
        assert _restored(manager) == 2
        assert manager._restorer.last_restore_uri == Path(mirror).as_uri()
        warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
        assert any("cannot be read" in m and s3_bucket in m for m in warned), warned
        with pytest.raises(SaveFailedError, match="nothing was committed"):  # root down
            manager.save(3, seam_run.state(3))


def test_a_step_damaged_at_the_root_loads_from_its_mirror_copy(tmp_path: Path) -> None:
    primary, mirror = str(tmp_path / "primary"), str(tmp_path / "mirror")
    _save(primary, (1, 2), mirrors=[mirror])
    largest = max(
        (p for p in (tmp_path / "primary" / step_folder(2)).rglob("*") if p.is_file()),
        key=lambda p: p.stat().st_size,
    )
    data = bytearray(largest.read_bytes())
    data[len(data) // 3] ^= 0x10
    largest.write_bytes(bytes(data))
    with CheckpointManager(primary, preemption=False, keep_last=None, mirrors=[mirror]) as job:
        assert _restored(job) == 2  # the same step, from the intact copy: nothing older
        assert Catalog(open_store(primary)).quarantined_attempts(2)
        assert job.steps() == [1]  # set aside at the root, where it can be saved again
    assert Catalog(open_store(mirror)).steps() == [1, 2]


def test_a_mirror_cannot_make_an_unsigned_step_the_newest(tmp_path: Path) -> None:
    key = str(write_signing_key(tmp_path / "key"))
    primary, mirror = str(tmp_path / "primary"), str(tmp_path / "mirror")
    _save(primary, (1, 2), signing_key=key, mirrors=[mirror])
    _save(mirror, (9,))  # unsigned, under the job's own identity (adopted by the mirror)
    with CheckpointManager(
        primary, preemption=False, keep_last=None, signing_key=key, mirrors=[mirror]
    ) as job:
        assert _restored(job) == 2
        assert job._restorer.last_restore_uri == Path(primary).as_uri()
    assert Catalog(open_store(mirror)).quarantined_attempts(9)


def test_another_jobs_root_named_as_a_mirror_is_never_restored(tmp_path: Path) -> None:
    primary, other = str(tmp_path / "primary"), str(tmp_path / "other")
    _save(primary, (1,))
    _save(other, (5,))  # another job's, with a newer step
    with CheckpointManager(primary, preemption=False, keep_last=None, mirrors=[other]) as job:
        assert _restored(job) == 1


def test_an_explicit_step_only_a_mirror_holds(tmp_path: Path) -> None:
    primary, mirror = str(tmp_path / "primary"), str(tmp_path / "mirror")
    _save(primary, (1, 2, 3), mirrors=[mirror])
    Catalog(open_store(primary)).delete_step(1)
    with CheckpointManager(primary, preemption=False, keep_last=None, mirrors=[mirror]) as job:
        assert _restored(job, step=1) == 1
        assert job._restorer.last_restore_uri == Path(mirror).as_uri()
        with pytest.raises(NoCheckpointError, match="or its mirrors"):
            job.restore(seam_run.blank(), step=7)


def test_without_mirrors_nothing_changes_and_a_mirror_copy_restores(tmp_path: Path) -> None:
    primary, mirror = str(tmp_path / "primary"), str(tmp_path / "mirror")
    _save(primary, (1, 2))
    Mirror(Catalog(open_store(primary)), Catalog(open_store(mirror))).catch_up()
    with CheckpointManager(mirror, preemption=False, keep_last=None) as job:
        assert _restored(job) == 2


def test_a_root_with_its_own_identity_never_restores_another_jobs_mirror(tmp_path: Path) -> None:
    primary, other = str(tmp_path / "primary"), str(tmp_path / "other")
    Catalog(open_store(primary)).ensure_job()  # this job's root, no step saved yet
    _save(other, (7,))
    with CheckpointManager(primary, preemption=False, keep_last=None, mirrors=[other]) as job:
        assert _restored(job) is None


def test_the_nearest_copy_setting_picks_the_copy_read_first(tmp_path: Path) -> None:
    primary, mirror = str(tmp_path / "primary"), str(tmp_path / "mirror")
    _save(primary, (1, 2), mirrors=[mirror])
    for nearest in (mirror, primary, mirror):
        with CheckpointManager(
            primary, preemption=False, keep_last=None, mirrors=[mirror], nearest_copy=nearest
        ) as job:
            assert _restored(job) == 2
            assert job._restorer.last_restore_uri == Path(nearest).as_uri()
    with pytest.raises(ConfigError, match=r"nearest_copy: .* neither the job's root nor"):
        CheckpointManager(
            primary, preemption=False, mirrors=[mirror], nearest_copy=str(tmp_path / "elsewhere")
        )
